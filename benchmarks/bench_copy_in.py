"""FSDP2's copy ops: our kernels vs torch's default ops vs one flat memcpy.

    python benchmarks/bench_copy_in.py [--device cpu|cuda] [--threads N] [--world-size 4] [--repeats 7]

For each op and size class, the same call through torch.ops.fsdp.* with our
kernels installed and with torch's own, and the physical bound: one copy of
the same bytes (with the same cast) between two flat buffers. Reports the
best of --repeats, in ms, and the ratios. The fp32->bf16 copy-in row compares
our single casting pass with FSDP's mixed-precision path (cast every shard,
then copy it in).

`call_floor_ms` is the same op called with as many empty tensors: what
passing the tensor list from Python through the dispatcher costs before any
kernel, ours or torch's, runs. On CUDA, `ours_gbps` / `memcpy_gbps` count
bytes read plus bytes written. The calls repeat the same tensors, as FSDP2
does every step, so ours reuse their kept plan (csrc/copy_plan_cache.h);
`ours_uncached_ms` (CUDA) forgets it before every call: planning and upload
included.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from _common import require_our_kernels_on
from megatron_fsdp import _torch_compat, kernels
from megatron_fsdp.kernels import fsdp_copy_ops

SIZES = {"many_small": (2000, 256), "medium": (200, 65536), "few_large": (20, 4 * 1024 * 1024)}


def best_ms(fn, repeats, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def compare(name, ours, torch_default, bound, floor, moved_bytes, repeats, device):
    fsdp_copy_ops.enable_fsdp_copy_kernels()
    t_ours = best_ms(ours, repeats, device)
    t_floor = best_ms(floor, repeats, device)
    if device.type == "cuda":  # every call planned afresh: what the kept plan saves
        ext = kernels._load_extension()
        t_uncached = best_ms(lambda: (ext.clear_copy_plan_caches(), ours()), repeats, device)
    fsdp_copy_ops.disable_fsdp_copy_kernels()
    t_torch = best_ms(torch_default, repeats, device)
    t_bound = best_ms(bound, repeats, device)
    row = {"case": name, "ours_ms": round(t_ours, 3), "torch_ms": round(t_torch, 3),
           "memcpy_ms": round(t_bound, 3), "call_floor_ms": round(t_floor, 3),
           "torch_over_ours": round(t_torch / t_ours, 2), "ours_over_memcpy": round(t_ours / t_bound, 2)}
    if device.type == "cuda":
        row["ours_uncached_ms"] = round(t_uncached, 3)
        row["ours_gbps"] = round(moved_bytes / t_ours / 1e6, 1)
        row["memcpy_gbps"] = round(moved_bytes / t_bound / 1e6, 1)
    return row


def bench_size(size_name: str, world: int, repeats: int, device: torch.device) -> list[dict]:
    count, numel = SIZES[size_name]
    rank = 1
    rows = []
    shards = [torch.randn(numel, device=device) for _ in range(count)]
    total = count * numel
    flat_src = torch.randn(total, device=device)
    empties = [torch.empty(0, device=device) for _ in range(count)]
    none_out = torch.empty(0, device=device)

    # all-gather copy-in: shards into this rank's slice of the all-gather buffer
    ag_out = torch.empty(total * world, device=device)
    dst = ag_out[total * rank: total * (rank + 1)]
    copy_in = lambda: torch.ops.fsdp.all_gather_copy_in(shards, ag_out, [numel] * count, total, rank)  # noqa: E731
    copy_in_floor = lambda: torch.ops.fsdp.all_gather_copy_in(empties, none_out, [0] * count, 0, rank)  # noqa: E731
    rows.append(compare(f"all_gather_copy_in/{size_name}/fp32", copy_in, copy_in,
                        lambda: dst.copy_(flat_src), copy_in_floor, 8 * total, repeats, device))
    # fp32 -> bf16: ours casts while copying; FSDP's mixed-precision path casts
    # each shard first, then copies it in.
    ag_out16 = torch.empty(total * world, dtype=torch.bfloat16, device=device)
    dst16 = ag_out16[total * rank: total * (rank + 1)]
    rows.append(compare(
        f"all_gather_copy_in/{size_name}/fp32->bf16",
        lambda: torch.ops.fsdp.all_gather_copy_in(shards, ag_out16, [numel] * count, total, rank),
        lambda: torch.ops.fsdp.all_gather_copy_in([s.to(torch.bfloat16) for s in shards], ag_out16,
                                                  [numel] * count, total, rank),
        lambda: dst16.copy_(flat_src), copy_in_floor, 6 * total, repeats, device))

    # all-gather copy-out: [world, total] into each parameter's [world, numel]
    gathered = ag_out.view(world, total)
    outs = [torch.empty(world, numel, device=device) for _ in range(count)]
    flat_dst = torch.empty(world * total, device=device)
    copy_out = lambda: torch.ops.fsdp.split_with_sizes_copy(gathered, [numel] * count, dim=1, out=outs)  # noqa: E731
    empty_outs = [torch.empty(world, 0, device=device) for _ in range(count)]
    copy_out_floor = lambda: torch.ops.fsdp.split_with_sizes_copy(  # noqa: E731
        torch.empty(world, 0, device=device), [0] * count, dim=1, out=empty_outs)
    rows.append(compare(f"split_with_sizes_copy/{size_name}/fp32", copy_out, copy_out,
                        lambda: flat_dst.copy_(ag_out), copy_out_floor, 8 * world * total, repeats, device))

    # reduce-scatter copy-in: uneven gradients (rows not divisible by world) into [world, chunk]
    grads = [torch.randn(numel // 8 + 1, 8, device=device) for _ in range(count)]
    cols = sum(-(-g.size(0) // world) * 8 for g in grads)
    rs_in = torch.empty(world, cols, device=device)
    flat_grads = torch.randn(world * cols, device=device)
    chunk_cat = lambda: torch.ops.fsdp.chunk_cat(grads, 0, world, out=rs_in)  # noqa: E731
    one_row = [torch.empty(1, 0, device=device) for _ in range(count)]
    chunk_cat_floor = lambda: torch.ops.fsdp.chunk_cat(  # noqa: E731
        one_row, 0, world, out=torch.empty(world, 0, device=device))
    rows.append(compare(f"chunk_cat/{size_name}/fp32", chunk_cat, chunk_cat,
                        lambda: rs_in.view(-1).copy_(flat_grads), chunk_cat_floor,
                        4 * (sum(g.numel() for g in grads) + world * cols), repeats, device))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sizes", default=",".join(SIZES))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    _torch_compat.fsdp_collectives_module()  # registers the fsdp:: ops
    require_our_kernels_on(device)
    if not fsdp_copy_ops.enable_fsdp_copy_kernels():
        raise SystemExit("our kernels could not be installed (see the warning above)")
    rows = []
    for size_name in args.sizes.split(","):
        if size_name not in SIZES:
            raise SystemExit(f"--sizes: unknown size {size_name!r}; choose from {', '.join(SIZES)}")
        rows += bench_size(size_name, args.world_size, args.repeats, device)
    fsdp_copy_ops.enable_fsdp_copy_kernels()
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
