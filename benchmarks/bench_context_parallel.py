"""Context parallelism: per-rank activation memory and step time at CP 1, 2, 4 ... of one long sequence.

    torchrun --nproc-per-node 4 benchmarks/bench_context_parallel.py [--cp-comm-type p2p all_gather a2a]
    torchrun --nproc-per-node 8 benchmarks/bench_context_parallel.py --preset gpu
    python benchmarks/bench_context_parallel.py ...   (a world of one: CP 1 alone)

The N processes of a torchrun job measure, one after another, every CP size c that divides N
(or those --cp-sizes names): the ranks form TP 1 x CP c x DP N/c (parallel_state torn down and built
again between sizes), and a GPTModel (RoPE, SwiGLU, RMSNorm, no biases, GQA: --hidden-size,
--num-layers, --num-attention-heads, --num-query-groups, --ffn-hidden-size, --vocab-size) in
TorchFullyShardedDataParallel with get_megatron_optimizer's AdamW (FSDP shards over the flattened
DP x CP ranks: the same N at every c, so weights, gradients and optimizer state per rank do not
change with c). Each DP rank trains on one micro-batch of --seq-length tokens; each CP rank feeds
its two load-balanced chunks of it (megatron_fsdp.utils.get_batch_on_this_cp_rank: --seq-length /
c tokens per rank). A step is zero grads, forward (the per-token loss, its mean), backward,
finish_grad_sync, optimizer.step. At CP 1 the attention is plain SDPA whatever the comm type, so
CP 1 is measured once and is the baseline of every --cp-comm-type (p2p, all_gather, a2a, a2a+p2p;
a2a is skipped where the heads or query groups do not divide by c; a2a+p2p runs at c >= 4 with
--hierarchical-context-parallel-sizes 2 c/2, the a2a within neighbouring pairs, the ring across).

Per arm, after --warmup steps, --steps timed steps; reported (rank 0: a table, then one JSON line):
  step ms          the median over the timed steps of the slowest rank's step (a barrier, and on
                   CUDA a synchronize, before each step; a synchronize after it)
  saved MiB        activation memory as the bytes of the tensors autograd saves for the backward
                   in one (untimed, warm-up) forward: torch.autograd.graph.saved_tensors_hooks,
                   unique storages' nbytes, the parameters' storages (FSDP's unsharded weights)
                   left out. The largest rank's. Measured on every device; the
                   CPU's only measure
  peak MiB         (CUDA only) torch.cuda.max_memory_allocated over forward and backward less
                   torch.cuda.memory_allocated before the forward, the largest rank's (the median
                   over the timed steps): the saved activations plus everything transient (FSDP's
                   unsharded weights and gradients of a layer, the attention's work buffers, the
                   logits' gradient)
  x CP 1           each figure over CP 1's in the same run: memory should approach 1/c, the step
                   (each rank does 1/c of a sequence's work, plus the communication) too
  first loss       the mean per-token loss of DP rank 0's sequence in the first step (before any
                   update; its CP ranks' sums added): the same weights and tokens at every CP size,
                   so the same figure in every row to the dtype's precision (a check, not a timing)

One JSON line ("case": "context_parallel"; "ours_ms": the step of the first --cp-comm-type (p2p by
default) at the largest CP size it ran at, "ours_arm" which, "cp1_ms" CP 1's; "first_loss_max_abs_diff"
the largest difference of a row's first loss from CP 1's; then per arm "<comm>_cp<c>_ms",
"_ms_ratio", "_saved_mib", "_saved_ratio", and on CUDA "_peak_mib", "_peak_ratio"), as
scripts/gpu_check.sh reads it.

Device: one GPU per process with NCCL when CUDA is available (set per LOCAL_RANK), else gloo on the
CPU with the machine's cores split between the local processes. CP needs one rank per GPU: on a
machine with one GPU only CP 1 can be measured.

Presets: cpu (the default without CUDA: 2 layers, hidden 128, 8 heads, 4 query groups, ffn 512,
vocab 1024, seq 2048, fp32; under a minute on 4 processes of a 2-core machine) and gpu (the default
with CUDA: the Llama-8B layer, hidden 4096, 32 heads, 8 query groups, ffn 14336, 2 layers, vocab
32768, seq 16384, bf16). Flags given override the preset's values.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from _common import device_name, single_process_defaults, start_process_group
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training.initialize import distributed_job
from megatron_fsdp.transformer import TransformerConfig
from megatron_fsdp.transformer.enums import CP_COMM_TYPES
from megatron_fsdp.utils import get_batch_on_this_cp_rank

PROG = "bench_context_parallel.py"
MIB = 2 ** 20
PRESETS = {
    "cpu": dict(hidden_size=128, num_layers=2, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512,
                vocab_size=1024, seq_length=2048, bf16=False),
    "gpu": dict(hidden_size=4096, num_layers=2, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                vocab_size=32768, seq_length=16384, bf16=True),
}


def _error(message: str) -> SystemExit:
    """One line, as scripts/gpu_check.sh finds it in a log."""
    rank = f" on rank {dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""
    return SystemExit(f"{PROG}: error{rank}: {message}")


# ---------------------------------------------------------------- measures


class SavedTensorBytes:
    """Within it, the bytes of the storages autograd saves for the backward (each storage once),
    the parameters' storages left out: those of `model`'s parameters as they are at the time (FSDP's
    unsharded weights while their module runs; a weight saved as its transpose is a view of them)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.storages: dict[tuple, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.nbytes() and key not in self.storages:
            parameters = {(p.device, p.untyped_storage().data_ptr()) for p in self.model.parameters()
                          if not isinstance(p, DTensor)}  # (sharded DTensors: not what the forward uses)
            if key not in parameters:
                self.storages[key] = storage.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=parallel_state.get_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---------------------------------------------------------------- one arm


def _config(args, cp: int, comm_type: str, cuda: bool) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=args.bf16, context_parallel_size=cp, cp_comm_type=comm_type,
        hierarchical_context_parallel_sizes=_hierarchical_sizes(cp, comm_type),
        # The GPU's fused activation and loss (bench_e2e's api arm); the CPU runs the eager paths.
        bias_activation_fusion=cuda, cross_entropy_loss_fusion=cuda)


def _hierarchical_sizes(cp: int, comm_type: str):
    return [2, cp // 2] if comm_type == "a2a+p2p" else None


def run_arm(args, cp: int, comm_type: str) -> dict:
    """One CP size and comm type: build, warm up (the saved-tensor count in the first forward),
    time; returns the slowest/largest rank's figures."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp,
                                             hierarchical_context_parallel_sizes=_hierarchical_sizes(cp, comm_type))
    try:
        device = parallel_state.get_device()
        cuda = device.type == "cuda"
        config = _config(args, cp, comm_type, cuda)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        model = GPTModel(config, vocab_size=args.vocab_size, max_sequence_length=args.seq_length,
                         position_embedding_type="rope")
        model = TorchFullyShardedDataParallel(config, DistributedDataParallelConfig(), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=args.bf16, adam_eps=1e-5, clip_grad=1.0),
                                           model)
        # One micro-batch of --seq-length tokens per DP rank; this CP rank's two chunks of it.
        g = torch.Generator().manual_seed(args.seed + parallel_state.get_data_parallel_rank())
        tokens = torch.randint(0, args.vocab_size, (1, args.seq_length), generator=g)
        mine = get_batch_on_this_cp_rank({"tokens": tokens.to(device),
                                          "position_ids": torch.arange(args.seq_length, device=device)[None]})
        ids, positions = mine["tokens"], mine["position_ids"]

        def sync():
            if cuda:
                torch.cuda.synchronize()

        def step(saved: SavedTensorBytes | None = None) -> tuple[float, float, torch.Tensor]:
            """(seconds, peak bytes over forward and backward less the bytes before it (0 on the CPU),
            this rank's sum of the per-token losses)."""
            sync()
            dist.barrier()
            start = time.perf_counter()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            if cuda:
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            if saved is not None:
                with saved:
                    loss = model(ids, positions, None, labels=ids)
            else:
                loss = model(ids, positions, None, labels=ids)
            loss = loss.float()
            loss.mean().backward()
            peak = torch.cuda.max_memory_allocated() - before if cuda else 0
            model.finish_grad_sync()
            optimizer.step()
            sync()
            return time.perf_counter() - start, peak, loss.detach().sum()

        saved = SavedTensorBytes(model)
        # The first step's loss, before any update: DP rank 0's sequence, whole (summed over its CP
        # group); the same at every CP size and comm type, to the dtype's precision.
        first_loss = step(saved)[2]
        dist.all_reduce(first_loss, group=parallel_state.get_context_parallel_group())
        for _ in range(args.warmup - 1):
            step()
        times, peaks = [], []
        for _ in range(args.steps):
            seconds, peak, _ = step()
            times.append(seconds)
            peaks.append(peak)
        # Each step's slowest rank, then the median over the steps; memory: the largest rank's.
        times = _max_over_ranks(times)
        peaks = _max_over_ranks(peaks)
        saved_bytes = _max_over_ranks([saved.nbytes])[0]
        result = {"ms": 1000 * statistics.median(times), "saved_bytes": saved_bytes,
                  "first_loss": first_loss.item() / args.seq_length}  # rank 0's: DP rank 0's sequence
        if cuda:
            result["peak_bytes"] = statistics.median(peaks)
        return result
    finally:
        parallel_state.destroy_model_parallel()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- the report


def report(args, world: int, results: dict, skipped: list[str]) -> None:
    cuda = torch.cuda.is_available()
    base = results[(1, "-")]
    cps = sorted({cp for cp, _ in results if cp > 1})
    # "ours": the first comm type asked for (p2p by default) at the largest CP size it ran at.
    ours = max((cp for cp, comm in results if comm == args.cp_comm_type[0]), default=None)
    out = {"case": "context_parallel",
           "ours_ms": round(results[(ours, args.cp_comm_type[0])]["ms"] if ours else base["ms"], 2),
           "ours_arm": f"{args.cp_comm_type[0]} at CP {ours}" if ours else "CP 1",
           "cp1_ms": round(base["ms"], 2),
           "cp1_saved_mib": round(base["saved_bytes"] / MIB, 2), "cp1_first_loss": round(base["first_loss"], 6),
           "first_loss_max_abs_diff": max(abs(r["first_loss"] - base["first_loss"]) for r in results.values())}
    if cuda:
        out["cp1_peak_mib"] = round(base["peak_bytes"] / MIB, 1)
    rows = []
    for (cp, comm), r in sorted(results.items(), key=lambda kv: (kv[0][0] > 1, kv[0][1], kv[0][0])):
        row = dict(comm=comm if cp > 1 else "(any)", cp=cp, dp=world // cp, tokens=args.seq_length // cp, ms=r["ms"],
                   ms_ratio=r["ms"] / base["ms"], saved=r["saved_bytes"] / MIB,
                   saved_ratio=r["saved_bytes"] / base["saved_bytes"], first_loss=r["first_loss"])
        if cuda:
            row.update(peak=r["peak_bytes"] / MIB, peak_ratio=r["peak_bytes"] / base["peak_bytes"])
        rows.append(row)
        if cp > 1:
            key = f"{comm}_cp{cp}"
            out.update({f"{key}_ms": round(row["ms"], 2), f"{key}_ms_ratio": round(row["ms_ratio"], 3),
                        f"{key}_saved_mib": round(row["saved"], 2), f"{key}_saved_ratio": round(row["saved_ratio"], 3)})
            if cuda:
                out.update({f"{key}_peak_mib": round(row["peak"], 1), f"{key}_peak_ratio": round(row["peak_ratio"], 3)})
    out.update(world_size=world, cp_sizes=[1, *cps], device=device_name(), torch=torch.__version__,
               memory="saved tensors and peak allocated" if cuda else "saved tensors",
               hidden_size=args.hidden_size, num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
               num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size,
               vocab_size=args.vocab_size, seq_length=args.seq_length, dtype="bf16" if args.bf16 else "fp32",
               steps=args.steps)

    print(f"GPT: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, "
          f"{args.num_query_groups} query groups, ffn {args.ffn_hidden_size}, vocab {args.vocab_size}, RoPE, SwiGLU, "
          f"{'bf16' if args.bf16 else 'fp32'}; one sequence of {args.seq_length} tokens per DP rank; {world} rank(s), "
          f"{device_name()}, torch {torch.__version__}; {args.steps} timed steps (medians of the slowest rank)")
    print("memory per rank: " + ("'saved' = bytes of the tensors saved for backward (parameters left out); "
                                 "'peak' = max_memory_allocated over forward+backward less the allocated bytes "
                                 "before the forward" if cuda else
                                 "'saved' = bytes of the tensors saved for backward (parameters left out); "
                                 "no allocator peak on the CPU"))
    head = (f"{'comm':<11} {'CP':>3} {'DP':>3} {'tok/rank':>8} {'step ms':>9} {'x CP1':>6} {'saved MiB':>10} "
            f"{'x CP1':>6}")
    if cuda:
        head += f" {'peak MiB':>10} {'x CP1':>6}"
    print(head + f" {'1/CP':>6} {'first loss':>10}")
    for r in rows:
        line = (f"{r['comm']:<11} {r['cp']:>3} {r['dp']:>3} {r['tokens']:>8} {r['ms']:>9.1f} {r['ms_ratio']:>6.3f} "
                f"{r['saved']:>10.2f} {r['saved_ratio']:>6.3f}")
        if cuda:
            line += f" {r['peak']:>10.1f} {r['peak_ratio']:>6.3f}"
        print(line + f" {1 / r['cp']:>6.3f} {r['first_loss']:>10.6f}")
    for note in skipped:
        print(f"skipped: {note}")
    if world == 1:
        print("a world of one: CP 1 alone (CP c needs c ranks: torchrun --nproc-per-node N, c dividing N)")
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- main


def _divisors(n: int) -> list[int]:
    return [c for c in range(1, n + 1) if n % c == 0]


def main():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: gpu when CUDA is available, else cpu; the flags below override its values")
    p.add_argument("--cp-comm-type", nargs="+", choices=CP_COMM_TYPES, default=list(CP_COMM_TYPES),
                   help="the comm types measured at every CP size above 1 (default: all)")
    p.add_argument("--cp-sizes", type=int, nargs="+", default=None,
                   help="CP sizes, each dividing the world size (default: every divisor of it); 1 is always measured")
    for flag in ("--hidden-size", "--num-layers", "--num-attention-heads", "--num-query-groups", "--ffn-hidden-size",
                 "--vocab-size", "--seq-length"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights and compute (default: the preset's: gpu yes, cpu no)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first counts the saved tensors)")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    preset = PRESETS[args.preset or ("gpu" if torch.cuda.is_available() else "cpu")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup < 1 or args.steps < 1:
        p.error(f"--warmup and --steps must be at least 1, got {args.warmup} and {args.steps}")
    if args.hidden_size % args.num_attention_heads or args.num_attention_heads % args.num_query_groups:
        p.error(f"--hidden-size {args.hidden_size}, --num-attention-heads {args.num_attention_heads} and "
                f"--num-query-groups {args.num_query_groups}: each must divide the one before")

    single_process_defaults()
    world = int(os.environ["WORLD_SIZE"])
    cps = sorted(set(args.cp_sizes or _divisors(world)) - {1})
    for cp in cps:
        if cp < 1 or world % cp:
            p.error(f"--cp-sizes {cp} does not divide the world size {world}")
        if args.seq_length % (2 * cp):
            p.error(f"--seq-length {args.seq_length} is not divisible by 2 x CP ({2 * cp})")
    start_process_group(_error)
    with distributed_job():
        results, skipped = {(1, "-"): run_arm(args, 1, "p2p")}, []
        for cp in cps:
            for comm in args.cp_comm_type:
                a2a = {"a2a": cp, "a2a+p2p": 2}.get(comm)
                if comm == "a2a+p2p" and cp < 4:
                    skipped.append(f"a2a+p2p at CP {cp}: it needs CP >= 4 (2 a2a x CP/2 p2p)")
                    continue
                if a2a and (args.num_attention_heads % a2a or args.num_query_groups % a2a):
                    skipped.append(f"{comm} at CP {cp}: {args.num_attention_heads} heads and {args.num_query_groups} "
                                   f"query groups do not both divide by {a2a}")
                    continue
                results[(cp, comm)] = run_arm(args, cp, comm)
        if dist.get_rank() == 0:
            report(args, world, results, skipped)


if __name__ == "__main__":
    sys.exit(main())
