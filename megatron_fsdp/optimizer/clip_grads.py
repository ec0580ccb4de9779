"""Gradient norm, clipping and zero counts over parameters sharded any way.

A DTensor gradient's local statistics are summed over the mesh dimensions on
which it is sharded and not over those on which it is replicated, so every
element counts exactly once whether it is split by TP, by FSDP, or both. A
plain tensor gradient is taken to be replicated (norm weights, for instance).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _torch_compat

_Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]


def _as_list(tensors: _Tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _shard_groups(t: DTensor) -> tuple:
    """Groups of the mesh dims `t` is split over. Every non-replicated
    placement splits (FSDP's _StridedShard is not a Shard subclass)."""
    mesh = t.device_mesh
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"gradient has a Partial placement {t.placements}: reduce it before taking its norm")
    return tuple(mesh.get_group(i) for i, p in enumerate(t.placements) if not p.is_replicate())


def _reduce_over_shards(grads: list[torch.Tensor], local_stat: Callable[[list[torch.Tensor]], torch.Tensor],
                        op) -> torch.Tensor:
    """`op` (SUM or MAX) of `local_stat` over every gradient element, the
    same on every rank: one reduction per distinct set of sharded mesh dims.
    `local_stat` takes one bucket's local tensors at once, so that a bucket
    of a hundred gradients costs one multi-tensor op, not a hundred."""
    buckets: dict[tuple, list] = {}
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        groups = _shard_groups(g) if isinstance(g, DTensor) else ()
        # The mesh's device: under FSDP2's CPU offload the shards live on the CPU, the
        # collectives (NCCL) on the GPU.
        device = torch.device(g.device_mesh.device_type) if isinstance(g, DTensor) else local.device
        # Keyed by group name: ProcessGroup wrappers are not unique objects.
        bucket = buckets.setdefault(tuple(pg.group_name for pg in groups), [groups, device, []])
        bucket[2].append(local.detach())
    is_max = op == dist.ReduceOp.MAX
    total = None
    for groups, device, locals_ in buckets.values():
        value = local_stat(locals_).to(device)
        for group in groups:  # one reduction per sharded mesh dimension
            dist.all_reduce(value, op=op, group=group)
        total = value if total is None else (torch.maximum(total, value) if is_max else total + value)
    return total


def _norms_fp32(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each tensor's `norm_type` norm, accumulated in fp32, stacked: one op for the bucket
    (torch's `_foreach_norm`, what `clip_grad_norm_` uses: multi-tensor kernels where the
    tensors share a device and dtype, as the optimizer's fp32 main gradients do)."""
    return torch.stack(_torch_compat.foreach_norm(tensors, norm_type, dtype=torch.float32))


def get_grad_norm_fp32(grads_for_norm: _Tensors, norm_type: Union[int, float] = 2) -> float:
    """The norm of all gradients together, the same value on every rank."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    grads = _as_list(grads_for_norm)
    if not grads:
        return 0.0
    if norm_type == math.inf:
        return float(_reduce_over_shards(grads, lambda ts: _norms_fp32(ts, math.inf).max(), dist.ReduceOp.MAX))
    total = _reduce_over_shards(grads, lambda ts: (_norms_fp32(ts, norm_type) ** norm_type).sum(),
                                dist.ReduceOp.SUM)
    return float(total ** (1.0 / norm_type))


def count_zeros_fp32(parameters: _Tensors) -> int:
    """The number of zero elements in the gradients of `parameters`, each
    element counted once across TP and DP: the same value on every rank."""
    grads = [p.grad for p in _as_list(parameters) if p.grad is not None]
    if not grads:
        return 0
    # int64: a float32 count is inexact above 2**24 elements.
    return int(_reduce_over_shards(
        grads, lambda ts: torch.stack([(t == 0).sum(dtype=torch.int64) for t in ts]).sum(), dist.ReduceOp.SUM))


def clip_grad_by_total_norm_fp32(parameters: _Tensors, max_norm: float, total_norm: float) -> None:
    """Scale every gradient by max_norm / total_norm when that is below 1."""
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        # The local shards in one multi-tensor op: a DTensor op per gradient costs its
        # dispatch on the host, right after the norm's read made the device wait.
        grads = [_torch_compat.local_tensor(p.grad) for p in _as_list(parameters) if p.grad is not None]
        with torch.no_grad():
            _torch_compat.foreach_mul_(grads, clip_coeff)


def clip_grad_norm_(parameters: _Tensors, max_norm: float, norm_type: Union[int, float] = 2) -> float:
    """Clip gradients to a total norm of `max_norm`; returns the norm before clipping."""
    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    params = [p for p in _as_list(parameters) if p.grad is not None]
    total_norm = get_grad_norm_fp32([p.grad for p in params], norm_type)
    clip_grad_by_total_norm_fp32(params, max_norm, total_norm)
    return total_norm
