"""One GPT, side by side in one run: our API, our pretrain() loop, and a plain
PyTorch Llama of the same shapes with `fully_shard` per block (torchtitan's
recipe), each eager and with `torch.compile` per block.

    python benchmarks/bench_e2e.py [--preset 1b|8b|tiny] [--steps 10] [--no-compile] [--pretrain]
    torchrun --nproc-per-node N benchmarks/bench_e2e.py ...

Arms (bf16 compute, fp32 master weights and gradient reduction, AdamW, gradients clipped at norm 1):
  api             GPTModel in TorchFullyShardedDataParallel, get_megatron_optimizer: one step is
                  zero grads, forward, backward, finish_grad_sync, optimizer.step;
                  bias_activation_fusion and cross_entropy_loss_fusion on (Megatron-LM's default
                  for the first, off by default the second), RoPE in the activations' dtype
  api+compile     the same with torch_compile=True (--torch-compile): each TransformerLayer compiled
  plain           a Llama written here in plain PyTorch (RMSNorm, RoPE, GQA through SDPA, SwiGLU),
                  fully_shard per block and at the root with MixedPrecisionPolicy(bf16, fp32
                  reduce), torch.optim.AdamW (fused on CUDA)
  plain+compile   the same, each block compiled
  fully_shard     the same plain Llama through megatron_fsdp.fully_shard (NVIDIA Megatron-FSDP's
                  API on our FSDP plan): built in bf16, MixedPrecisionPolicy(fp32 main weights,
                  fp32 gradient reduction), each Block a unit; against plain (+compile likewise)
  pretrain        (--pretrain) examples/pretrain_gpt.py with the same shapes and Megatron's
                  default flags for them, in a subprocess: its own logged time per iteration.
                  Megatron's defaults make another model than the api arm's: dropout 0.1 (hidden
                  and attention), apply_rope_fusion and bias_dropout_fusion (fp32 arithmetic)
  pretrain:api_model  (--pretrain) the same with the api arm's model (--attention-dropout 0
                  --hidden-dropout 0 --no-rope-fusion --no-bias-dropout-fusion
                  --cross-entropy-loss-fusion): what the training loop adds to the api step
                  ("api_over_ours" in both pretrain rows)

Arms run one after another (two 1B models with Adam state do not share an 80 GB GPU
comfortably); each is built, warmed up (`--warmup` steps: compilation, optimizer state),
timed over `--steps` steps (the median) and freed. Reported per arm: ms/step, tokens/s
and TFLOP/s per GPU (Megatron-LM's FLOP formula, training.flops), MFU against the bf16
matmul rate measured in the same run, peak GPU memory. One JSON line per arm ("case",
"ours_ms"; "torch_ms" is the plain arm of the same compile setting, "torch_over_ours"
their ratio), then a table.

Presets: 1b (16 layers, hidden 2048, 16 heads, 8 KV groups, ffn 8192, vocab 32768, seq
2048, micro-batch 4: issue 19's Llama-1B-like shape), 8b (8 layers, hidden 4096, 32
heads, 8 groups, ffn 14336, micro-batch 2: the Llama-8B layer shape), tiny (the CPU's).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from _common import api_step, dense_bf16_tflops, device_name, single_process_defaults
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training.flops import num_floating_point_operations
from megatron_fsdp.training.initialize import distributed_job
from megatron_fsdp.transformer import TransformerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = {
    "1b": dict(layers=16, hidden=2048, heads=16, groups=8, ffn=8192, vocab=32768, seq=2048, micro_batch=4),
    "8b": dict(layers=8, hidden=4096, heads=32, groups=8, ffn=14336, vocab=32768, seq=2048, micro_batch=2),
    "tiny": dict(layers=2, hidden=64, heads=4, groups=2, ffn=256, vocab=512, seq=64, micro_batch=2),
}


# ---------------------------------------------------------------- the plain PyTorch Llama

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _rope(x, cos, sin):  # x [b, s, heads, d]: rotate the two halves, as Megatron's non-interleaved RoPE
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Block(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.heads, self.groups, self.head_dim = s["heads"], s["groups"], s["hidden"] // s["heads"]
        self.attention_norm, self.ffn_norm = RMSNorm(s["hidden"]), RMSNorm(s["hidden"])
        self.wq = nn.Linear(s["hidden"], s["hidden"], bias=False)
        self.wkv = nn.Linear(s["hidden"], 2 * self.groups * self.head_dim, bias=False)
        self.wo = nn.Linear(s["hidden"], s["hidden"], bias=False)
        self.w13 = nn.Linear(s["hidden"], 2 * s["ffn"], bias=False)
        self.w2 = nn.Linear(s["ffn"], s["hidden"], bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim)
        k, v = self.wkv(h).view(b, t, 2, self.groups, self.head_dim).unbind(2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class PlainLlama(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.embed = nn.Embedding(s["vocab"], s["hidden"])
        self.layers = nn.ModuleList(Block(s) for _ in range(s["layers"]))
        self.norm = RMSNorm(s["hidden"])
        self.output = nn.Linear(s["hidden"], s["vocab"], bias=False)
        d = s["hidden"] // s["heads"]
        freqs = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        angles = torch.outer(torch.arange(s["seq"]).float(), freqs).repeat(1, 2)  # [seq, d]
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, labels):
        x = self.embed(ids)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


# ---------------------------------------------------------------- the arms

# Every arm clips the gradients' global norm at 1.0: Megatron's default (--clip-grad, the api
# arm's OptimizerConfig) and torchtitan's (max_norm); the plain arms with torch's clip_grad_norm_.
CLIP_GRAD = 1.0

def _api_arm(s, device, compile_layers: bool):
    config = TransformerConfig(
        num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
        num_query_groups=s["groups"], ffn_hidden_size=s["ffn"], gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=True, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=True, cross_entropy_loss_fusion=True)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = GPTModel(config, vocab_size=s["vocab"], max_sequence_length=s["seq"], position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    ddp_config = TorchFullyShardedDataParallelConfig(fsdp_copy_kernels=True, torch_compile=compile_layers)
    model = TorchFullyShardedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=True, clip_grad=CLIP_GRAD), model)
    positions = torch.arange(s["seq"], device=device).expand(s["micro_batch"], -1)

    return lambda ids: api_step(model, optimizer, ids, positions)


def _plain_arm(s, device, compile_layers: bool):
    torch.manual_seed(1234)
    model = PlainLlama(s).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        if compile_layers:
            layer.compile()
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def step(ids):
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD, foreach=True)
        optimizer.step()
        return loss
    return step


def _fully_shard_arm(s, device, compile_layers: bool):
    """The plain Llama through megatron_fsdp.fully_shard (NVIDIA Megatron-FSDP's API): built in
    bf16 (the compute dtype), fp32 main weights and gradient reduction, each Block a unit."""
    from megatron_fsdp import MixedPrecisionPolicy as MainPolicy, fully_shard as megatron_fully_shard

    torch.manual_seed(1234)
    model = PlainLlama(s).to(device=device, dtype=torch.bfloat16)
    if compile_layers:
        for layer in model.layers:
            layer.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    model, optimizer = megatron_fully_shard(
        model, optimizer, fsdp_unit_modules=[Block],
        mixed_precision_policy=MainPolicy(main_params_dtype=torch.float32, grad_comm_dtype=torch.float32))

    def step(ids):
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids, ids)
        loss.backward()
        model.finish_grad_sync()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD, foreach=True)
        optimizer.step()
        return loss
    return step


def _timed(step, ids, warmup: int, steps: int) -> tuple[float, float, float]:
    """(median ms per step, peak GiB allocated, last loss)."""
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step(ids)
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(ids)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0
    return 1000 * statistics.median(times), peak, float(loss.detach())


def _pretrain_flags(s) -> list[str]:
    return ["--use-torch-fsdp2", "--bf16", "--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
            "--num-attention-heads", str(s["heads"]), "--group-query-attention", "--num-query-groups",
            str(s["groups"]), "--ffn-hidden-size", str(s["ffn"]), "--seq-length", str(s["seq"]),
            "--max-position-embeddings", str(s["seq"]), "--micro-batch-size", str(s["micro_batch"]),
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--vocab-size", str(s["vocab"]),
            "--make-vocab-size-divisible-by", "128", "--mock-data", "--lr", "1e-4", "--eval-iters", "0"]


# The pretrain arms: extra flags after Megatron's defaults for the shape.
PRETRAIN_ARMS = {"pretrain": [],
                 "pretrain:api_model": ["--attention-dropout", "0", "--hidden-dropout", "0", "--no-rope-fusion",
                                        "--no-bias-dropout-fusion", "--cross-entropy-loss-fusion"]}


def _pretrain_ms(s, world: int, steps: int, extra: list[str]) -> float:
    """examples/pretrain_gpt.py's own logged time per iteration: 2 x `steps` iterations logged
    every `steps`, the second line (the first covers the warm-up)."""
    flags = _pretrain_flags(s) + extra + ["--global-batch-size", str(s["micro_batch"] * world), "--train-iters",
                                  str(2 * steps), "--log-interval", str(steps)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                           "--standalone", os.path.join(ROOT, "examples", "pretrain_gpt.py"), *flags],
                          capture_output=True, text=True, env=env, timeout=1800)
    found = re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", proc.stdout + proc.stderr)
    if proc.returncode != 0 or len(found) < 2:
        raise SystemExit(f"bench_e2e: the pretrain arm failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(found[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=None, help="default: 3 (10 with compile)")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled arms")
    p.add_argument("--pretrain", action="store_true", help="also time examples/pretrain_gpt.py")
    p.add_argument("--arms", default=None, help="comma-separated subset of api, plain, fully_shard, each "
                                                 "with or without +compile")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    s = PRESETS[args.preset or ("1b" if cuda else "tiny")]
    names = ["api", "plain", "fully_shard"] + ([] if args.no_compile or not cuda else
                                               ["api+compile", "plain+compile", "fully_shard+compile"])
    if args.arms:
        names = [n for n in args.arms.split(",") if n]
    single_process_defaults()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    results = {}
    with distributed_job():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        device = parallel_state.get_device()
        world = dist.get_world_size()
        g = torch.Generator().manual_seed(dist.get_rank())
        ids = torch.randint(0, s["vocab"], (s["micro_batch"], s["seq"]), generator=g).to(device)
        for name in names:
            build = {"api": _api_arm, "plain": _plain_arm, "fully_shard": _fully_shard_arm}[name.split("+")[0]]
            step = build(s, device, compile_layers=name.endswith("+compile"))
            warmup = args.warmup if args.warmup is not None else (10 if name.endswith("+compile") else 3)
            results[name] = _timed(step, ids, warmup, args.steps)
            del step
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        peak_rate = dense_bf16_tflops(device, 8192 if cuda else 512)
        parallel_state.destroy_model_parallel()
        rank = dist.get_rank()
        if args.pretrain:  # rank 0 launches it on as many GPUs; the others wait
            if rank == 0:
                for name, extra in PRETRAIN_ARMS.items():
                    results[name] = (_pretrain_ms(s, world, args.steps, extra), float("nan"), float("nan"))
            dist.barrier()
    flops = num_floating_point_operations(SimpleNamespace(
        num_attention_heads=s["heads"], group_query_attention=True, num_query_groups=s["groups"], kv_channels=None,
        hidden_size=s["hidden"], ffn_hidden_size=s["ffn"], num_layers=s["layers"], seq_length=s["seq"], swiglu=True,
        padded_vocab_size=s["vocab"]), s["micro_batch"] * world)
    if rank == 0:
        rows = []
        for name, (ms, peak_gib, loss) in results.items():
            tflops = flops / (ms / 1000) / 1e12 / world
            baseline = "plain+compile" if "compile" in name else "plain"
            row = {"case": f"e2e {name}", "ours_ms": round(ms, 2),
                   "tokens_per_s_per_gpu": round(s["micro_batch"] * s["seq"] / (ms / 1000)),
                   "tflops_per_gpu": round(tflops, 3), "mfu": round(tflops / peak_rate, 3),
                   "peak_gib": round(peak_gib, 2), "last_loss": round(loss, 4), "device": device_name(),
                   "torch": torch.__version__, "world_size": world, "measured_bf16_tflops": round(peak_rate, 1),
                   **{k: v for k, v in s.items()}}
            if not name.startswith("plain") and baseline in results:
                row.update(torch_ms=round(results[baseline][0], 2),
                           torch_over_ours=round(results[baseline][0] / ms, 3))
            if name in PRETRAIN_ARMS and "api" in results:  # issue 19's target: at least 0.95
                row.update(api_ms=round(results["api"][0], 2), api_over_ours=round(results["api"][0] / ms, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
        shape = ", ".join(f"{k} {v}" for k, v in s.items())
        print(f"\n{shape}; {world} rank(s), {device_name()}, bf16 matmul {peak_rate:.0f} TFLOP/s")
        print(f"{'arm':<20} {'ms/step':>9} {'tok/s/GPU':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}")
        for r in rows:
            print(f"{r['case'][4:]:<20} {r['ours_ms']:>9.1f} {r['tokens_per_s_per_gpu']:>10} "
                  f"{r['tflops_per_gpu']:>8.1f} {r['mfu']:>6.1%} {r['peak_gib']:>9.2f}")


if __name__ == "__main__":
    main()
