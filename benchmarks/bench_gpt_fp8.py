"""fp8 training against bf16 in one run: step time, tokens/s, MFU, all-gather bytes.

    # CPU, gloo, TP2 x DP2:
    torchrun --nproc-per-node 4 benchmarks/bench_gpt_fp8.py --tp 2
    # one GPU, a GPT with hidden 4096 (scripts/gpu_check.sh runs it so, without torchrun):
    python benchmarks/bench_gpt_fp8.py --preset gpu
    # issue 20's shapes: --preset 1b, --preset 8b --arms bf16,fp8 (80 GB)

Three arms wrap the same GPT (same seed) with TorchFullyShardedDataParallel
under bf16 mixed precision:
  bf16            the baseline: bf16 GEMMs, bf16 weight all-gather
  fp8             fp8 GEMMs (tensorwise scaling, e4m3), bf16 all-gather
  fp8 + fp8 gather  fp8 GEMMs and fp8 weight all-gather (fp8_param_gather)
and on request (--arms): "fp8 delayed" (delayed scaling), and "bf16 compiled",
"fp8 compiled", "fp8 delayed compiled" (torch_compile: each TransformerLayer
compiled; the first, counted step of each arm pays the compilation).
A step is forward, backward and AdamW (with fp8 weights the optimizer
refreshes their scales). Steps alternate between arms in rounds
(benchmarks/_common.py). All-gather bytes (all parameters, fp8
and not) are counted by wrapping the collective over one step. MFU is the model's FLOPs (Megatron-LM's
formula, megatron_fsdp.training.flops) per second over the bf16 dense-matmul
rate measured on this device in the same run. One more profiled step per arm
gives the shares of its op time spent in GEMMs and in fp8 casts (with their
amaxes). Rank 0 prints a table and one
JSON line per arm (with a "case" key, as scripts/gpu_check.sh reads them).
Started without torchrun, it runs as a single process; with no arguments on
a CUDA machine it uses `--preset gpu`.
"""

from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from _common import (add_gpt_arguments, api_step, build_gpt, dense_bf16_tflops, device_name, gpt_benchmark_job,
                     single_process_defaults, time_arms_in_rounds)
from megatron_fsdp import parallel_state
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training.flops import num_floating_point_operations

_TENSORWISE = dict(fp8="e4m3", fp8_recipe="tensorwise")
ARMS = {  # name: (TransformerConfig fields, TorchFullyShardedDataParallelConfig fields)
    "bf16": (dict(), dict()),
    "fp8": (_TENSORWISE, dict()),
    "fp8 + fp8 gather": (_TENSORWISE, dict(fp8_param_gather=True)),
    # Not run by default (--arms): Megatron's default recipe, and per-layer compile of each.
    "fp8 delayed": (dict(fp8="e4m3", fp8_recipe="delayed"), dict()),
    "bf16 compiled": (dict(), dict(torch_compile=True)),
    "fp8 compiled": (_TENSORWISE, dict(torch_compile=True)),
    "fp8 delayed compiled": (dict(fp8="e4m3", fp8_recipe="delayed"), dict(torch_compile=True)),
}
DEFAULT_ARMS = ("bf16", "fp8", "fp8 + fp8 gather")


class CountAllGatherBytes:
    """Bytes every all-gather on this rank receives, while on. FSDP2 calls
    `dist.all_gather_single` (torch >= 2.13) or `all_gather_into_tensor`."""

    def __init__(self):
        self.bytes = 0
        self.on = False
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(dist, name):
                setattr(dist, name, self._counting(getattr(dist, name)))

    def _counting(self, original):
        def collective(output, input, *args, **kwargs):
            if self.on:
                self.bytes += output.numel() * output.element_size()
            return original(output, input, *args, **kwargs)
        return collective


# gpu: hidden 4096, about 1.1B parameters; three arms with fp32 masters and Adam
# state take about 52 GB, within one 80 GB GPU. 1b and 8b: issue 20's shapes
# (a Llama-1B-like GPT, and 8 layers of Llama-8B's shape; attention with as
# many key/value heads as query heads, a GELU MLP of that width). 8b holds
# about 1.7B parameters: with all three arms about 84 GB of state, so on an
# 80 GB GPU pass --arms "bf16,fp8".
PRESETS = {
    "gpu": dict(layers=4, hidden=4096, heads=32, seq=2048, micro_batch=2, vocab=32768, rounds=3),
    "1b": dict(layers=16, hidden=2048, heads=16, ffn_hidden=8192, seq=2048, micro_batch=4, vocab=32768, rounds=3),
    "8b": dict(layers=8, hidden=4096, heads=32, ffn_hidden=14336, seq=2048, micro_batch=2, vocab=32768, rounds=3),
}
# What a step's time is spent in, by op (the self time of each; on CUDA its kernels' time).
GEMM_OPS = ("aten::_scaled_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
CAST_OPS = ("megatron_fsdp::cast_transpose_to_fp8", "megatron_fsdp::cast_to_fp8", "megatron_fsdp::multi_tensor_amax",
            "aten::aminmax", "aten::amax", "aten::clamp", "aten::_to_copy")


def time_shares(step, device) -> dict:
    """One profiled step: the shares of its op time spent in GEMMs and in fp8 casts (with their
    amaxes; under bf16, `aten::_to_copy` counts the casts of the mixed-precision policy)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    ops = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    def self_time(e):
        # (torch >= 2.11 names it self_device_time_total; self_cuda_time_total is gone there)
        return e.self_device_time_total if cuda else e.self_cpu_time_total
    total = sum(self_time(e) for e in ops) or 1
    return {"gemm_share": sum(self_time(e) for e in ops if e.key in GEMM_OPS) / total,
            "cast_share": sum(self_time(e) for e in ops if e.key in CAST_OPS) / total}


def main():
    p = argparse.ArgumentParser()
    add_gpt_arguments(p, steps_per_round=2)
    p.add_argument("--ffn-hidden", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--matmul-size", type=int, default=None, help="operand size of the peak-rate probe")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="; ".join(f"{name}: {preset}" for name, preset in PRESETS.items()))
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                   help=f"a comma-separated subset of {list(ARMS)} (default: {', '.join(DEFAULT_ARMS)})")
    argv = sys.argv[1:]
    if not argv and torch.cuda.is_available():
        argv = ["--preset", "gpu"]
    args = p.parse_args(argv)
    if args.preset:
        p.set_defaults(**PRESETS[args.preset])
        args = p.parse_args(argv)
    chosen = [a.strip() for a in args.arms.split(",") if a.strip()]
    if "bf16" not in chosen or any(a not in ARMS for a in chosen):
        p.error(f"--arms: {args.arms!r}; a comma-separated subset of {list(ARMS)} that holds bf16 (the baseline)")
    single_process_defaults()

    with gpt_benchmark_job(args) as base_config:
        import dataclasses

        device = parallel_state.get_device()
        counter = CountAllGatherBytes()
        arms = {}
        for name in chosen:
            fields, ddp_fields = ARMS[name]
            config = dataclasses.replace(base_config, bf16=True, ffn_hidden_size=args.ffn_hidden or 4 * args.hidden,
                                         **fields)
            ddp_config = TorchFullyShardedDataParallelConfig(fsdp_copy_kernels=True, **ddp_fields)
            model = TorchFullyShardedDataParallel(config, ddp_config, build_gpt(args, config))
            optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=True), model)
            arms[name] = (model, optimizer)
        config = arms["bf16"][0].config

        g = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
        positions = torch.arange(args.seq, device=device).expand(args.micro_batch, -1)
        losses = {}

        def step(name):
            losses[name] = api_step(*arms[name], ids, positions).item()

        gathered = {}
        for name in arms:  # one counted step per arm (also the warm-up of optimizer state)
            counter.bytes, counter.on = 0, True
            step(name)
            counter.on = False
            gathered[name] = counter.bytes
        step_ms = time_arms_in_rounds(step, arms, args.rounds, args.steps_per_round)
        shares = {name: time_shares(lambda: step(name), device) for name in arms}

        dp = parallel_state.get_data_parallel_world_size()
        world = dist.get_world_size()
        flops_args = SimpleNamespace(
            num_attention_heads=args.heads, group_query_attention=False, num_query_groups=None,
            kv_channels=None, hidden_size=args.hidden, ffn_hidden_size=config.ffn_hidden_size,
            num_layers=args.layers, seq_length=args.seq, swiglu=False, padded_vocab_size=args.vocab)
        flops_per_step = num_floating_point_operations(flops_args, args.micro_batch * dp)
        peak = dense_bf16_tflops(device, args.matmul_size or (8192 if device.type == "cuda" else 1024))
        tokens_per_step = args.micro_batch * args.seq * dp
        result = {"world_size": world, "tp": args.tp, "dp": dp, "device": device_name(),
                  "layers": args.layers, "hidden": args.hidden, "seq": args.seq, "micro_batch": args.micro_batch,
                  "dense_bf16_tflops_per_rank": peak, "arms": {}}
        for name in arms:
            seconds = step_ms[name] / 1000
            tflops = flops_per_step / seconds / 1e12 / world
            result["arms"][name] = {
                "step_ms": step_ms[name], "tokens_per_s_per_rank": tokens_per_step / seconds / world,
                "tflops_per_rank": tflops, "mfu_vs_measured_bf16": tflops / peak,
                "speedup_vs_bf16": step_ms["bf16"] / step_ms[name],
                "all_gather_bytes_per_rank_per_step": gathered[name],
                "all_gather_ratio_vs_bf16": gathered[name] / max(gathered["bf16"], 1),
                "last_loss": losses[name], **shares[name],
            }
        if dist.get_rank() == 0:
            print(f"TP{args.tp} x DP{dp}, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
                  f"micro batch {args.micro_batch}, {result['device']}; measured bf16 matmul "
                  f"{peak:.2f} TFLOP/s per rank")
            print(f"{'arm':<22} {'step ms':>9} {'x bf16':>7} {'tok/s/rank':>11} {'TFLOP/s':>8} {'MFU':>6} "
                  f"{'AG MiB/step':>12} {'AG x bf16':>10} {'GEMMs':>6} {'casts':>6}")
            for name, r in result["arms"].items():
                print(f"{name:<22} {r['step_ms']:>9.1f} {r['speedup_vs_bf16']:>7.2f} "
                      f"{r['tokens_per_s_per_rank']:>11.0f} {r['tflops_per_rank']:>8.2f} "
                      f"{r['mfu_vs_measured_bf16']:>6.1%} {r['all_gather_bytes_per_rank_per_step'] / 2**20:>12.2f} "
                      f"{r['all_gather_ratio_vs_bf16']:>10.3f} {r['gemm_share']:>6.1%} {r['cast_share']:>6.1%}")
            common = {k: v for k, v in result.items() if k != "arms"}
            for name, r in result["arms"].items():
                print(json.dumps({"case": f"gpt {name}", "ours_ms": round(r["step_ms"], 3),
                                  "bf16_ms": round(step_ms["bf16"], 3), "speedup": round(r["speedup_vs_bf16"], 3),
                                  **{k: v for k, v in r.items() if k not in ("step_ms", "speedup_vs_bf16")},
                                  **common}), flush=True)


if __name__ == "__main__":
    main()
