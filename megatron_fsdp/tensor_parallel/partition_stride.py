"""Tensors split across TP ranks with Megatron's `partition_stride`.

A ColumnParallelLinear built with `stride=s` (a gated MLP's fc1: s=2, its
gate and up projections) cuts its full weight into s x TP equal row slices,
and TP rank r holds slices r, TP + r, ..., (s - 1) x TP + r, one after the
other. For fc1 that is Megatron-Core's layout: each rank holds [gate_r; up_r],
so its forward splits the output in halves with a view. The full tensor,
[gate; up] for fc1, is the same at every TP size (Megatron's TP=1 layout):
initialization draws it, checkpoints store it, export writes it.

The parameter's DTensor, though, is Shard(0) of the ranks' local tensors
laid end to end, the "blocks" [gate_0; up_0; gate_1; up_1; ...], which
depend on the TP size: `full_tensor()` returns them, `from_blocks` turns
them into the full tensor, and `full_row_runs` maps a range of block rows
to the full tensor's rows (DCP reads and writes those).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def stride_of(param: torch.Tensor) -> int:
    """The parameter's partition_stride (1: a plain split)."""
    return int(getattr(param, "partition_stride", 1))


def strided_parameters(model: torch.nn.Module) -> dict[str, int]:
    """{parameter name: partition_stride} of `model`'s parameters with a stride above 1
    (a state dict's tensors lose the attribute: this names them)."""
    return {name: stride_of(p) for name, p in model.named_parameters() if stride_of(p) != 1}


def _check(size: int, stride: int, tp: int) -> int:
    if stride < 1 or tp < 1 or size % (stride * tp) != 0:
        raise ValueError(f"{size} rows cannot be cut into partition_stride {stride} x TP {tp} equal slices")
    return size // (stride * tp)


def to_blocks(full: torch.Tensor, stride: int, tp: int) -> torch.Tensor:
    """The full tensor -> every TP rank's rows laid end to end (rank r: slices r, TP + r, ...)."""
    if stride == 1 or tp == 1:
        _check(full.size(0), stride, tp)
        return full
    return torch.cat([rank_rows(full, stride, tp, r) for r in range(tp)])


def rank_rows(full: torch.Tensor, stride: int, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s rows of the full tensor (a view when stride is 1)."""
    _check(full.size(0), stride, tp)
    slices = full.chunk(stride * tp)
    if stride == 1:
        return slices[rank]
    return torch.cat([slices[k * tp + rank] for k in range(stride)])


def from_blocks(blocks: torch.Tensor, stride: int, tp: int) -> torch.Tensor:
    """The inverse of `to_blocks` (rows are only reordered)."""
    _check(blocks.size(0), stride, tp)
    if stride == 1 or tp == 1:
        return blocks
    slices = blocks.chunk(stride * tp)
    return torch.cat([slices[r * stride + k] for k in range(stride) for r in range(tp)])


def full_rows(rows: torch.Tensor, size: int, stride: int, tp: int) -> torch.Tensor:
    """The full tensor's row index of each block row index in `rows` (of `size` rows in all)."""
    width = _check(size, stride, tp)
    rank, within = rows // (stride * width), rows % (stride * width)
    return (within // width * tp + rank) * width + within % width


def full_row_runs(start: int, length: int, size: int, stride: int, tp: int) -> list[tuple[int, int, int]]:
    """Block rows [start, start + length) as runs of consecutive full rows:
    (offset from `start`, first full row, rows) for each."""
    width = _check(size, stride, tp)
    runs, done = [], 0
    while done < length:
        row = start + done
        n = min(width - row % width, length - done)
        runs.append((done, int(full_rows(torch.tensor(row), size, stride, tp)), n))
        done += n
    return runs


def full_value(tensor: torch.Tensor, stride: int, tp: int) -> torch.Tensor:
    """The full tensor of a parameter of partition_stride `stride`, or of its gradient or
    optimizer state: `full_tensor()` (a collective for a DTensor), from blocks to full."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return from_blocks(full, stride, tp)
