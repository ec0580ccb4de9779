"""The fp8 helper kernels: multi-tensor amax and the scaled cast to fp8.

    python benchmarks/bench_amax.py [--device cpu|cuda] [--threads N] [--repeats 15] [--dtype float32]

amax, per case (a set of weights):
  ours      megatron_fsdp.kernels.multi_tensor_amax (the kernel's direct entry)
  op        torch.ops.megatron_fsdp.multi_tensor_amax (the same kernel through the dispatcher)
  foreach   torch.stack(torch._foreach_norm(weights, inf)): torchao's way, what fp8 code uses without us
  per_tensor  our fallback: t.abs().amax() per weight, then one stack
  bound     torch.amax over one flat buffer of the same bytes: a single reduction, the physical bound
cast (one tensor): ours (`kernels.cast_to_fp8`) vs torch's `(x.float() * s).clamp(-m, m).to(fp8)`,
and a plain copy of as many bytes (read 4, write 1 per element) as the bound.
cast-transpose (one 8192 x 2048 activation): ours (`kernels.cast_transpose_to_fp8`: both fp8
layouts and the amax in one pass) vs torch's cast, `.t().contiguous()` and amax; the bound reads
the input once and writes two bytes per element (issue 20's target: within 1.3x of it).

Every arm runs once per round, rounds alternate the arms (noise hits all
alike); each arm's best round is reported, in ms, with the ratios and, on
CUDA, GB/s read. Results are checked equal before timing. One JSON line per
case on stdout.
"""

from __future__ import annotations

import argparse
import json

import torch

from _common import best_of_rounds, require_our_kernels_on
from megatron_fsdp import _torch_compat, kernels
from megatron_fsdp.kernels.amax import _multi_tensor_amax_reference

CASES = {  # name: (count, elements each)
    "200x64K": (200, 65536),
    "200x4K": (200, 4096),
    "4x16M": (4, 16 * 1024 * 1024),
}


def bench_amax(name: str, dtype: torch.dtype, repeats: int, device: torch.device) -> dict:
    count, numel = CASES[name]
    g = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(numel, generator=g, device=device).to(dtype) for _ in range(count)]
    flat = torch.cat(weights)
    inf = float("inf")
    ours = kernels.multi_tensor_amax(weights)
    foreach = torch.stack(_torch_compat.foreach_norm(weights, inf)).float()
    if not torch.equal(ours, foreach):
        raise SystemExit(f"{name}: multi_tensor_amax differs from _foreach_norm(inf): {ours} vs {foreach}")
    ms = best_of_rounds({
        "ours": lambda: kernels.multi_tensor_amax(weights),
        "op": lambda: torch.ops.megatron_fsdp.multi_tensor_amax(weights),
        "foreach": lambda: torch.stack(_torch_compat.foreach_norm(weights, inf)),
        "per_tensor": lambda: _multi_tensor_amax_reference(weights),
        "bound": lambda: torch.amax(flat),
    }, repeats, device)
    nbytes = flat.numel() * flat.element_size()
    row = {"case": f"amax/{name}/{str(dtype).replace('torch.', '')}", "ours_ms": round(ms["ours"], 4),
           "op_ms": round(ms["op"], 4), "foreach_ms": round(ms["foreach"], 4), "per_tensor_ms": round(ms["per_tensor"], 4),
           "bound_ms": round(ms["bound"], 4),
           "foreach_over_ours": round(ms["foreach"] / ms["ours"], 2), "ours_over_bound": round(ms["ours"] / ms["bound"], 2)}
    if device.type == "cuda":
        row["ours_gbps"] = round(nbytes / ms["ours"] / 1e6, 1)
        row["bound_gbps"] = round(nbytes / ms["bound"] / 1e6, 1)
    return row


def bench_cast(dtype: torch.dtype, repeats: int, device: torch.device) -> dict:
    numel = 16 * 1024 * 1024
    x = (torch.randn(numel, device=device) * 300).to(dtype)
    scale = torch.tensor(0.9, device=device)
    out = torch.empty(numel, dtype=torch.uint8, device=device)
    fp8, fp8_max = torch.float8_e4m3fn, 448.0
    torch_cast = lambda: (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8).view(torch.uint8)  # noqa: E731
    if not torch.equal(kernels.cast_to_fp8(x, scale, fp8, out=out), torch_cast()):
        raise SystemExit("cast_to_fp8 differs from torch's clamp + cast")
    ms = best_of_rounds({
        "ours": lambda: kernels.cast_to_fp8(x, scale, fp8, out=out),
        "torch": torch_cast,
        # Read x once (a reduction) and write out once (a fill): the memory traffic of one pass.
        "bound": lambda: (x.amax(), out.fill_(0)),
    }, repeats, device)
    row = {"case": f"cast_to_fp8/16M/{str(dtype).replace('torch.', '')}->e4m3", "ours_ms": round(ms["ours"], 4),
           "torch_ms": round(ms["torch"], 4), "bound_ms": round(ms["bound"], 4),
           "torch_over_ours": round(ms["torch"] / ms["ours"], 2), "ours_over_bound": round(ms["ours"] / ms["bound"], 2)}
    if device.type == "cuda":
        row["ours_gbps"] = round(numel * (x.element_size() + 1) / ms["ours"] / 1e6, 1)
    return row


def bench_cast_transpose(dtype: torch.dtype, repeats: int, device: torch.device) -> dict:
    """One activation of the 1B shape (8192 tokens x 2048): both fp8 layouts and the amax, ours in
    one pass against torch's cast, transpose made contiguous and amax (what the fp8 linear did)."""
    rows, cols = 8192, 2048
    x = (torch.randn(rows, cols, device=device) * 300).to(dtype)
    scale = torch.tensor(0.9, device=device)
    fp8, fp8_max = torch.float8_e4m3fn, 448.0

    def torch_way():
        cast = (x.float() * scale).clamp(-fp8_max, fp8_max).to(fp8).view(torch.uint8)
        return cast, cast.t().contiguous(), x.abs().amax().float()

    ours = kernels.cast_transpose_to_fp8(x, scale, fp8)
    expected = torch_way()
    if not (torch.equal(ours[0], expected[0]) and torch.equal(ours[1], expected[1])
            and torch.equal(ours[2].reshape(()), expected[2])):
        raise SystemExit("cast_transpose_to_fp8 differs from torch's cast, transpose and amax")
    out = torch.empty(2 * rows * cols, dtype=torch.uint8, device=device)
    ms = best_of_rounds({
        "ours": lambda: kernels.cast_transpose_to_fp8(x, scale, fp8),
        "torch": torch_way,
        # Read x once (a reduction) and write two bytes per element (a fill): one pass's traffic.
        "bound": lambda: (x.amax(), out.fill_(0)),
    }, repeats, device)
    row = {"case": f"cast_transpose_to_fp8/8192x2048/{str(dtype).replace('torch.', '')}->e4m3",
           "ours_ms": round(ms["ours"], 4), "torch_ms": round(ms["torch"], 4), "bound_ms": round(ms["bound"], 4),
           "torch_over_ours": round(ms["torch"] / ms["ours"], 2), "ours_over_bound": round(ms["ours"] / ms["bound"], 2)}
    if device.type == "cuda":
        row["ours_gbps"] = round(rows * cols * (x.element_size() + 2) / ms["ours"] / 1e6, 1)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    require_our_kernels_on(device)
    dtype = getattr(torch, args.dtype)
    for name in args.cases.split(","):
        if name not in CASES:
            raise SystemExit(f"--cases: unknown case {name!r}; choose from {', '.join(CASES)}")
        print(json.dumps(bench_amax(name, dtype, args.repeats, device)), flush=True)
    print(json.dumps(bench_cast(dtype, args.repeats, device)), flush=True)
    print(json.dumps(bench_cast_transpose(dtype, args.repeats, device)), flush=True)


if __name__ == "__main__":
    main()
