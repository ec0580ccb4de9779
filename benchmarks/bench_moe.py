"""One MoE layer, forward and backward: our MoELayer against a plain PyTorch MoE, per rank.

    python benchmarks/bench_moe.py [--preset cpu|gpu]                 (a world of one: arms 1-3)
    torchrun --nproc-per-node N benchmarks/bench_moe.py [--preset gpu] (and the EP = N arms)

Arms (the same weights and the same tokens on a rank; fp32 on the CPU, bf16 on the GPU):
  dense        the alternative: a plain PyTorch MoE as a user writes it (Hugging Face Mixtral's sparse
               block): a router (top-k logits, softmax over them), then a loop over the experts,
               each taking its tokens by torch.where on the top-k indices, gate/up/down GEMMs on them
               and index_add_ of the weighted result; one nn.Parameter per expert weight, all on one rank
  sequential   MoELayer with SequentialMLP (one GEMM per expert), the alltoall dispatcher, EP 1
  grouped      MoELayer with GroupedMLP (moe_grouped_gemm): torch's grouped GEMM where the device has
               it (CUDA, bf16, sm90+), else one GEMM per expert; the report says which ran (the calls
               of _torch_compat.grouped_mm in one forward are counted)
  ep<N>_alltoall, ep<N>_allgather   (torchrun N > 1, N dividing the experts) MoELayer with GroupedMLP
               at expert_model_parallel_size N with that dispatcher: each rank holds E/N experts
Every rank has its own --seq-length x --micro-batch-size tokens (its own micro-batch) in every arm, so
the per-rank work of an EP arm is that of the one-rank arms plus the communication. The one-rank arms
run on every rank at once (no communication between ranks) and take turns step by step; so do the EP
arms, in a parallel_state of their own. The two phases take turns in --rounds (each rebuilds its
arms and warms them up again), so that a busy spell of a shared machine falls on both. A step is
forward and backward of one layer (the output's gradient a fixed random tensor; the input requires
its gradient); no optimizer. Router: softmax top-k, no auxiliary losses, dropless, no shared expert,
no bias-activation fusion (the SwiGLU in the compute dtype, as the dense reference computes it).

Reported per arm (rank 0: a table, then one JSON line):
  step ms      the median over --rounds x --steps timed steps (each round after --warmup) of the
               slowest rank's step (a barrier, and on CUDA a synchronize, before each step; a
               synchronize after it)
  x dense      the arm's step over the dense reference's
  saved MiB    the bytes of the tensors autograd saves for the backward in the first step (saved-
               tensor hooks, unique storages, parameters left out), the largest rank's; the CPU's only
               memory measure
  peak MiB     (CUDA) max_memory_allocated over forward and backward less the bytes allocated before,
               the largest rank's median: saved activations, transients and the weights' gradients
  weights MiB  this rank's parameter bytes (EP holds 1/N of the experts)
  out / dx diff  the largest |difference| from the dense reference's output and input gradient on the
               same rank's tokens (the first step): the arms compute the same layer
  dispatch ms  (MoELayer arms, --profile-steps extra steps) the token dispatcher's six methods
               (dispatch_preprocess = permute, token_dispatch = all-to-all or all-gather,
               dispatch_postprocess = sort by local expert, their combine mirrors), forward and
               backward, summed; "comm" the two communicating ones alone. Measured by wrapping the
               dispatcher's methods on the instance (the library is unchanged) and marking their
               inputs' and outputs' gradients: before each interval the device is synchronized and
               the EP ranks meet in a barrier (so waiting for a slower rank is not counted), then
               perf_counter (CPU) or CUDA events. Share = dispatch ms / the arm's step ms. The
               median over the profiled steps (the last round's) of the slowest rank's sum
  load max     (MoELayer arms) the busiest rank's token rows through its experts over the ranks' mean:
               the routing's imbalance, which an EP step waits for (1 at EP 1)

One JSON line ("case": "moe"; "ours_ms" the grouped arm's step, "dense_ms" the reference's,
"dense_over_ours"; then "<arm>_ms", "_ratio", "_saved_mib", "_weights_mib", "_out_max_abs_diff",
"_peak_mib" (CUDA), "_dispatch_ms", "_comm_ms", "_dispatch_share", "_expert_load_max_over_mean";
"grouped_gemm": whether the grouped arm ran torch's grouped GEMM), as scripts/gpu_check.sh reads it.

Presets: cpu (the default without CUDA: hidden 256, 8 experts, top-2, ffn 512, 2 x 512 tokens, fp32,
3 rounds of 1 + 5 steps; 5-15 s on 1-2 processes of a 2-core machine) and gpu (the default with CUDA: a Mixtral-8x7B layer,
hidden 4096, 8 experts, top-2, ffn 14336, 2 x 4096 tokens, bf16, 1 round of 3 + 10 steps). Flags
given override the preset.
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
from torch import nn
from torch.distributed.tensor import DTensor

from _common import device_name, single_process_defaults, start_process_group
from _moe_measures import (COMM_METHODS, DISPATCH_METHODS, DispatchClock, SavedTensorBytes, count_grouped_mm, local,
                           profile_dispatcher)
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.training.initialize import distributed_job
from megatron_fsdp.transformer import TransformerConfig
from megatron_fsdp.transformer.moe import MoELayer

PROG = "bench_moe.py"
MIB = 2 ** 20
PRESETS = {
    "cpu": dict(hidden_size=256, num_experts=8, topk=2, ffn_hidden_size=512, seq_length=512, micro_batch_size=2,
                bf16=False, warmup=1, steps=5, rounds=3),
    "gpu": dict(hidden_size=4096, num_experts=8, topk=2, ffn_hidden_size=14336, seq_length=4096, micro_batch_size=2,
                bf16=True, warmup=3, steps=10, rounds=1),
}


# ---------------------------------------------------------------- weights and the reference


def draw_weights(args, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The full weights, the same on every rank (one seed, drawn on the device: the GPU preset's
    1.4G values would take seconds on the CPU). Scaled by 1/sqrt(fan-in) so that outputs are of
    order 1 and the differences between arms read as relative ones."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    E, H, Fe = args.num_experts, args.hidden_size, args.ffn_hidden_size

    def randn(*shape, fan_in):
        return (torch.randn(*shape, generator=g, device=device) / fan_in ** 0.5).to(dtype)

    return {"router": randn(E, H, fan_in=H), "fc1": randn(E, 2, Fe, H, fan_in=H), "fc2": randn(E, H, Fe, fan_in=Fe)}


class DenseMoE(nn.Module):
    """The alternative a user has: Hugging Face Mixtral's sparse MoE block (a loop over the experts,
    each expert its own weights), with the router of MoELayer's defaults: the top-k of the logits and
    a softmax over them (Mixtral's softmax over all experts renormalized over the top k is the same)."""

    def __init__(self, weights: dict[str, torch.Tensor], topk: int):
        super().__init__()
        self.topk = topk
        self.router = nn.Parameter(weights["router"].clone())
        self.gate = nn.ParameterList([w[0].clone() for w in weights["fc1"]])
        self.up = nn.ParameterList([w[1].clone() for w in weights["fc1"]])
        self.down = nn.ParameterList([w.clone() for w in weights["fc2"]])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # torch.matmul on [s, b, H], as the router computes its logits: the same values, so the same
        # top-k choice even where two logits round to a tie in bf16.
        logits = torch.matmul(hidden, self.router.t()).reshape(-1, self.router.size(0))
        x = hidden.reshape(-1, hidden.size(-1))
        top_logits, chosen = logits.topk(self.topk, dim=-1)
        weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(len(self.gate)):
            token, slot = torch.where(chosen == e)
            if token.numel() == 0:
                continue
            h = x[token]
            y = F.linear(F.silu(F.linear(h, self.gate[e])) * F.linear(h, self.up[e]), self.down[e])
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view_as(hidden)


def moe_config(args, ep: int, dispatcher: str, grouped: bool) -> TransformerConfig:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=1, hidden_size=args.hidden_size, num_attention_heads=8, ffn_hidden_size=args.ffn_hidden_size,
        num_moe_experts=args.num_experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn_hidden_size,
        moe_grouped_gemm=grouped, moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=ep,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=args.bf16, params_dtype=dtype,
        perform_initialization=False)  # the weights are written below


def build_moe_layer(config: TransformerConfig, weights: dict[str, torch.Tensor]) -> MoELayer:
    """MoELayer with the full `weights`, this EP rank keeping its experts."""
    layer = MoELayer(config, layer_number=1)
    mesh = parallel_state.get_expert_model_parallel_mesh()
    ep, rank = mesh.size(0), mesh.get_local_rank("ep")
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        for param, full in ((layer.experts.linear_fc1.weight, weights["fc1"]),
                            (layer.experts.linear_fc2.weight, weights["fc2"])):
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(full.chunk(ep)[rank])
    return layer


# ---------------------------------------------------------------- measures


def _over_ranks(values: list[float], op) -> list[float]:
    # (NCCL reduces device tensors only; gloo CPU ones)
    t = torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=op)
    return t.tolist()


def _max_over_ranks(values: list[float]) -> list[float]:
    return _over_ranks(values, dist.ReduceOp.MAX)


# ---------------------------------------------------------------- running the arms


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor, cuda: bool):
    """Forward and backward: (seconds, peak bytes less those before (0 on the CPU), output, dx)."""
    for p in model.parameters():
        p.grad = None
    x.grad = None
    _sync(cuda)
    dist.barrier()
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = model(x)
    out = out[0] if isinstance(out, tuple) else out  # MoELayer: (output, bias)
    out.backward(grad)
    _sync(cuda)
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated() - before if cuda else 0), out.detach(), x.grad


def measure(args, models: dict[str, nn.Module], x, grad, cuda: bool, results: dict, profile: bool) -> None:
    """The arms in `models` take turns step by step: --warmup steps, --steps timed ones, added to
    `results`; the very first step of an arm (a warm-up step) counts the saved tensors and grouped
    GEMM calls and keeps the output and input gradient. With `profile`, --profile-steps more with
    the dispatcher profiled (MoELayer arms)."""
    for i in range(args.warmup + args.steps):
        for name, model in models.items():
            r = results.setdefault(name, {"times": [], "peaks": []})
            if "out" not in r:
                calls = [0]
                with SavedTensorBytes(model) as saved, count_grouped_mm(calls):
                    _, _, r["out"], dx = step(model, x, grad, cuda)
                r.update(saved=sum(saved.storages.values()), dx=dx.clone(), grouped_mm_calls=calls[0])
                r["weights"] = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
                continue
            seconds, peak, _, _ = step(model, x, grad, cuda)
            if i >= args.warmup:
                r["times"].append(seconds)
                r["peaks"].append(peak)
    for name, model in models.items():
        if profile and isinstance(model, MoELayer):
            results[name]["dispatch"] = _profile(args, model, x, grad, cuda)


def _profile(args, layer: MoELayer, x, grad, cuda: bool) -> dict:
    """{"steps": [{method.forward/backward: ms}] per profiled step, "expert_rows": this rank's}."""
    ep_group = layer.token_dispatcher.ep_group
    per_step = []
    for _ in range(args.profile_steps):
        clock = DispatchClock(cuda, ep_group if ep_group.size() > 1 else None)
        with profile_dispatcher(layer, clock):
            step(layer, x, grad, cuda)
        per_step.append(clock.ms())
    return {"steps": per_step, "expert_rows": clock.expert_rows}


def _summary(r: dict) -> dict:
    """Each step's slowest rank, then the median over the steps; memory: the largest rank's."""
    out = {"ms": 1000 * statistics.median(_max_over_ranks(r["times"])), "out": r["out"], "dx": r["dx"],
           "saved_bytes": _max_over_ranks([r["saved"]])[0], "weight_bytes": _max_over_ranks([r["weights"]])[0],
           "grouped_mm_calls": r["grouped_mm_calls"]}
    if torch.cuda.is_available():
        out["peak_bytes"] = statistics.median(_max_over_ranks(r["peaks"]))
    if "dispatch" in r:
        steps = r["dispatch"]["steps"]
        total = _max_over_ranks([sum(s.values()) for s in steps])
        comm = _max_over_ranks([sum(v for k, v in s.items() if k.split(".")[0] in COMM_METHODS) for s in steps])
        rows = r["dispatch"]["expert_rows"]
        out.update(dispatch_ms=statistics.median(total), comm_ms=statistics.median(comm),
                   methods={k: statistics.median(_max_over_ranks([s.get(k, 0.0) for s in steps]))
                            for k in sorted(steps[0])},
                   # The busiest rank's expert rows over the mean: what EP's slowest rank pays for routing.
                   imbalance=_max_over_ranks([rows])[0] * dist.get_world_size()
                   / max(_over_ranks([rows], dist.ReduceOp.SUM)[0], 1))
    return out


def run_phase(args, ep: int, arms: dict[str, tuple], x, grad, weights, cuda: bool, results: dict,
              profile: bool) -> None:
    """parallel_state at EP `ep`, the arms built ({name: ("dense",) or (dispatcher, grouped)}),
    measured into `results`, torn down."""
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        models = {}
        for name, arm in arms.items():
            if arm[0] == "dense":
                models[name] = DenseMoE(weights, args.topk)
            else:
                models[name] = build_moe_layer(moe_config(args, ep, *arm), weights)
        measure(args, models, x, grad, cuda, results, profile)
    finally:
        parallel_state.destroy_model_parallel()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- the report


def _diffs(results: dict, dense: dict) -> dict[str, tuple[float, float]]:
    """{arm: (largest |output - dense output|, largest |dx - dense dx|)} over the ranks."""
    diffs = {}
    for name, r in results.items():
        mine = [(r["out"] - dense["out"]).abs().max().item(), (r["dx"] - dense["dx"]).abs().max().item()]
        diffs[name] = tuple(_max_over_ranks(mine))
    return diffs


def _grouped_gemm_note(results: dict, cuda: bool) -> str:
    calls = results["grouped"]["grouped_mm_calls"]
    if calls:
        return f"torch grouped GEMM ({calls} calls of _torch_compat.grouped_mm per forward)"
    return ("one GEMM per expert: GroupedMLP fell back (its grouped GEMM needs CUDA, bf16 and compute "
            "capability 9.0+)" + ("" if cuda else "; on the CPU the grouped arm is the sequential arm's code"))


def _arm_line(name: str, r: dict, dense_ms: float, diffs: tuple, cuda: bool) -> str:
    line = (f"{name:<16} {r['ms']:>9.2f} {r['ms'] / dense_ms:>8.3f} {r['saved_bytes'] / MIB:>10.2f} "
            f"{r['weight_bytes'] / MIB:>12.2f}")
    line += f" {r['peak_bytes'] / MIB:>9.1f}" if cuda else ""
    if "dispatch_ms" in r:
        line += (f" {r['dispatch_ms']:>12.2f} {r['comm_ms']:>8.2f} {r['dispatch_ms'] / r['ms']:>6.3f}"
                 f" {r['imbalance']:>9.3f}")
    else:
        line += f" {'-':>12} {'-':>8} {'-':>6} {'-':>9}"
    return line + f" {diffs[0]:>9.2e} {diffs[1]:>9.2e}"


def _arm_json(name: str, r: dict, dense_ms: float, diffs: tuple, cuda: bool) -> dict:
    out = {f"{name}_ms": round(r["ms"], 3), f"{name}_ratio": round(r["ms"] / dense_ms, 3),
           f"{name}_saved_mib": round(r["saved_bytes"] / MIB, 2), f"{name}_weights_mib": round(r["weight_bytes"] / MIB, 2),
           f"{name}_out_max_abs_diff": float(f"{diffs[0]:.3g}")}
    if cuda:
        out[f"{name}_peak_mib"] = round(r["peak_bytes"] / MIB, 1)
    if "dispatch_ms" in r:
        out.update({f"{name}_dispatch_ms": round(r["dispatch_ms"], 3), f"{name}_comm_ms": round(r["comm_ms"], 3),
                    f"{name}_dispatch_share": round(r["dispatch_ms"] / r["ms"], 3),
                    f"{name}_expert_load_max_over_mean": round(r["imbalance"], 3)})
    return out


def report(args, world: int, results: dict, skipped: list[str]) -> None:
    cuda = torch.cuda.is_available()
    dense = results["dense"]
    diffs = _diffs(results, dense)
    scale = _max_over_ranks([dense["out"].abs().max().item()])[0]
    if dist.get_rank() != 0:
        return
    tokens, dtype = args.seq_length * args.micro_batch_size, "bf16" if args.bf16 else "fp32"
    print(f"MoE layer: hidden {args.hidden_size}, {args.num_experts} experts, top-{args.topk}, ffn "
          f"{args.ffn_hidden_size} (SwiGLU), {tokens} tokens per rank ({args.seq_length} x {args.micro_batch_size}), "
          f"{dtype}; {world} rank(s), {device_name()}, torch {torch.__version__}; forward + backward, median of "
          f"{args.rounds} x {args.steps} steps (the slowest rank's)")
    print(f"grouped arm: {_grouped_gemm_note(results, cuda)}")
    head = f"{'arm':<16} {'step ms':>9} {'x dense':>8} {'saved MiB':>10} {'weights MiB':>12}"
    head += f" {'peak MiB':>9}" if cuda else ""
    print(head + f" {'dispatch ms':>12} {'comm ms':>8} {'share':>6} {'load max':>9} {'out diff':>9} {'dx diff':>9}")
    out = {"case": "moe", "ours_ms": round(results["grouped"]["ms"], 3), "dense_ms": round(dense["ms"], 3),
           "dense_over_ours": round(dense["ms"] / results["grouped"]["ms"], 3)}
    for name, r in results.items():
        print(_arm_line(name, r, dense["ms"], diffs[name], cuda))
        out.update(_arm_json(name, r, dense["ms"], diffs[name], cuda))
    for name, r in results.items():
        if "methods" in r:
            print(f"dispatch, {name} (ms per step, forward/backward): " + ", ".join(
                f"{m} {r['methods'].get(m + '.forward', 0):.2f}/{r['methods'].get(m + '.backward', 0):.2f}"
                for m in DISPATCH_METHODS))
    print(f"the dense output's largest |value|: {scale:.3g} (the diffs are against it); 'load max': the busiest "
          "rank's expert rows over the ranks' mean")
    for note in skipped:
        print(f"skipped: {note}")
    out.update(grouped_gemm=bool(results["grouped"]["grouped_mm_calls"]), out_max_abs=float(f"{scale:.3g}"),
               world_size=world, device=device_name(), torch=torch.__version__, dtype=dtype,
               memory="saved tensors and peak allocated" if cuda else "saved tensors",
               hidden_size=args.hidden_size, num_experts=args.num_experts, topk=args.topk,
               ffn_hidden_size=args.ffn_hidden_size, tokens_per_rank=tokens, steps=args.rounds * args.steps)
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- main


def _error(message: str) -> SystemExit:
    rank = f" on rank {os.environ['RANK']}" if os.environ.get("WORLD_SIZE", "1") != "1" else ""
    return SystemExit(f"{PROG}: error{rank}: {message}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="default: gpu when CUDA is available, else cpu; the flags below override its values")
    for flag in ("--hidden-size", "--num-experts", "--topk", "--ffn-hidden-size", "--seq-length",
                 "--micro-batch-size", "--warmup", "--steps", "--rounds"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 weights and compute (default: the preset's: gpu yes, cpu no)")
    p.add_argument("--profile-steps", type=int, default=3, help="extra steps with the dispatcher profiled")
    p.add_argument("--ep-dispatchers", nargs="*", choices=("alltoall", "allgather"), default=["alltoall", "allgather"],
                   help="the EP arms' dispatchers (torchrun N > 1; none: no EP arm)")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    for key, value in PRESETS[args.preset or ("gpu" if torch.cuda.is_available() else "cpu")].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if min(args.warmup, args.steps, args.rounds, args.profile_steps) < 1:
        p.error("--warmup, --steps, --rounds and --profile-steps must be at least 1")
    if not 1 <= args.topk <= args.num_experts:
        p.error(f"--topk {args.topk} must be between 1 and --num-experts {args.num_experts}")
    if args.hidden_size % 8:
        p.error(f"--hidden-size {args.hidden_size} must be a multiple of 8 (the config's 8 attention heads)")
    return args


def _start(args) -> bool:
    """The process group: NCCL, one GPU per process, or gloo with the cores split; True on CUDA."""
    single_process_defaults()
    return start_process_group(_error)


def main():
    args = parse_args()
    cuda = _start(args)
    world = int(os.environ["WORLD_SIZE"])
    with distributed_job():
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        weights = draw_weights(args, device, dtype)
        # This rank's micro-batch (its own tokens) and the output's gradient, the same in every arm.
        g = torch.Generator(device=device).manual_seed(args.seed + 1 + dist.get_rank())
        shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
        x = torch.randn(shape, generator=g, device=device).to(dtype).requires_grad_(True)
        grad = torch.randn(shape, generator=g, device=device).to(dtype)
        phases, skipped = _phases(args, world)
        results = {}
        # The phases (each its own parallel_state) take turns in rounds, so that a busy spell of the
        # machine falls on the one-rank and the EP arms alike.
        for i in range(args.rounds):
            for ep, arms in phases:
                run_phase(args, ep, arms, x, grad, weights, cuda, results, profile=i == args.rounds - 1)
        report(args, world, {name: _summary(r) for name, r in results.items()}, skipped)


def _phases(args, world: int) -> tuple[list, list[str]]:
    """[(EP size, {arm: ("dense",) or (dispatcher, grouped GEMM)})], and the arms skipped."""
    phases = [(1, {"dense": ("dense",), "sequential": ("alltoall", False), "grouped": ("alltoall", True)})]
    if world == 1:
        return phases, ["EP arms: a world of one (torchrun --nproc-per-node N, N dividing the experts)"]
    if args.num_experts % world:
        return phases, [f"EP {world}: {args.num_experts} experts do not divide by it"]
    if args.ep_dispatchers:
        phases.append((world, {f"ep{world}_{d}": (d, True) for d in args.ep_dispatchers}))
    return phases, []


if __name__ == "__main__":
    sys.exit(main())
