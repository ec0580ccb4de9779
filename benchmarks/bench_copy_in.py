"""FSDP2's copy ops: our kernels vs torch's default ops vs one flat memcpy.

    python benchmarks/bench_copy_in.py [--threads N] [--world-size 4] [--repeats 7]

For each op and size class, the same call through torch.ops.fsdp.* with our
kernels installed and with torch's own, and the physical bound: one copy of
the same bytes (with the same cast) between two flat buffers. Reports the
best of --repeats, in ms, and the ratios. The fp32->bf16 copy-in row compares
our single casting pass with FSDP's mixed-precision path (cast every shard,
then copy it in).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (registers fsdp:: ops)

from megatron_fsdp.kernels import fsdp_copy_ops

SIZES = {"many_small": (2000, 256), "medium": (200, 65536), "few_large": (20, 4 * 1024 * 1024)}


def best_ms(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def compare(name, ours, torch_default, bound, repeats):
    fsdp_copy_ops.enable_fsdp_copy_kernels()
    t_ours = best_ms(ours, repeats)
    fsdp_copy_ops.disable_fsdp_copy_kernels()
    t_torch = best_ms(torch_default, repeats)
    t_bound = best_ms(bound, repeats)
    return {"case": name, "ours_ms": round(t_ours, 3), "torch_ms": round(t_torch, 3),
            "memcpy_ms": round(t_bound, 3), "torch_over_ours": round(t_torch / t_ours, 2),
            "ours_over_memcpy": round(t_ours / t_bound, 2)}


def bench_size(size_name: str, world: int, repeats: int) -> list[dict]:
    count, numel = SIZES[size_name]
    rank = 1
    rows = []
    shards = [torch.randn(numel) for _ in range(count)]
    total = count * numel
    flat_src = torch.randn(total)

    # all-gather copy-in: shards into this rank's slice of the all-gather buffer
    ag_out = torch.empty(total * world)
    dst = ag_out[total * rank: total * (rank + 1)]
    copy_in = lambda: torch.ops.fsdp.all_gather_copy_in(shards, ag_out, [numel] * count, total, rank)  # noqa: E731
    rows.append(compare(f"all_gather_copy_in/{size_name}/fp32", copy_in, copy_in,
                        lambda: dst.copy_(flat_src), repeats))
    # fp32 -> bf16: ours casts while copying; FSDP's mixed-precision path casts
    # each shard first, then copies it in.
    ag_out16 = torch.empty(total * world, dtype=torch.bfloat16)
    dst16 = ag_out16[total * rank: total * (rank + 1)]
    rows.append(compare(
        f"all_gather_copy_in/{size_name}/fp32->bf16",
        lambda: torch.ops.fsdp.all_gather_copy_in(shards, ag_out16, [numel] * count, total, rank),
        lambda: torch.ops.fsdp.all_gather_copy_in([s.to(torch.bfloat16) for s in shards], ag_out16,
                                                  [numel] * count, total, rank),
        lambda: dst16.copy_(flat_src), repeats))

    # all-gather copy-out: [world, total] into each parameter's [world, numel]
    gathered = ag_out.view(world, total)
    outs = [torch.empty(world, numel) for _ in range(count)]
    flat_dst = torch.empty(world * total)
    copy_out = lambda: torch.ops.fsdp.split_with_sizes_copy(gathered, [numel] * count, dim=1, out=outs)  # noqa: E731
    rows.append(compare(f"split_with_sizes_copy/{size_name}/fp32", copy_out, copy_out,
                        lambda: flat_dst.copy_(ag_out), repeats))

    # reduce-scatter copy-in: uneven gradients (rows not divisible by world) into [world, chunk]
    grads = [torch.randn(numel // 8 + 1, 8) for _ in range(count)]
    cols = sum(-(-g.size(0) // world) * 8 for g in grads)
    rs_in = torch.empty(world, cols)
    flat_grads = torch.randn(world * cols)
    chunk_cat = lambda: torch.ops.fsdp.chunk_cat(grads, 0, world, out=rs_in)  # noqa: E731
    rows.append(compare(f"chunk_cat/{size_name}/fp32", chunk_cat, chunk_cat,
                        lambda: rs_in.view(-1).copy_(flat_grads), repeats))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sizes", default=",".join(SIZES))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for size_name in args.sizes.split(","):
        rows += bench_size(size_name, args.world_size, args.repeats)
    fsdp_copy_ops.enable_fsdp_copy_kernels()
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
