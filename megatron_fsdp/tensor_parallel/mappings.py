"""Megatron-style communication as autograd functions.

Each pair is the adjoint of the other: what one does in forward, its partner
does in backward. Tensor-parallel regions split the last (hidden) dimension;
sequence-parallel regions split dimension 0 (activations are [s, b, h]).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import _torch_compat, parallel_state


# torch 2.13 renamed the single-tensor collectives; 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _tp_group(group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return parallel_state.get_tensor_model_parallel_group() if group is None else group


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return _torch_compat.traced_collective("all_reduce", x.contiguous(), group)
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    if x.size(dim) % world_size != 0:
        raise ValueError(
            f"cannot split dimension {dim} of size {x.size(dim)} evenly over "
            f"{world_size} tensor-parallel ranks"
        )
    part = x.chunk(world_size, dim=dim)[dist.get_rank(group)]
    if torch.compiler.is_compiling():
        # A fresh tensor, not a view of the input (a dim-0 chunk is contiguous already): torch
        # 2.11's torch.compile gave an autograd.Function that returns a view of its input a zero
        # gradient.
        return part.clone(memory_format=torch.contiguous_format)
    return part.contiguous()


def _all_gather_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return _torch_compat.traced_collective("all_gather", x, group)
    out = x.new_empty((world_size * x.size(0),) + tuple(x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out


def _all_gather_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    dim = dim % x.dim()
    gathered = _all_gather_dim0(x.movedim(dim, 0), group)
    return gathered.movedim(0, dim).contiguous()


def _reduce_scatter_dim0(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    if x.size(0) % world_size != 0:
        raise ValueError(
            f"cannot reduce-scatter dimension 0 of size {x.size(0)} over {world_size} "
            "tensor-parallel ranks (with sequence parallelism the sequence length must be "
            "divisible by the tensor-parallel size)"
        )
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return _torch_compat.traced_collective("reduce_scatter", x, group)
    out = x.new_empty((x.size(0) // world_size,) + tuple(x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
    return out


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along_dim(grad, -1, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_dim(grad, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_along_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


def _all_to_all_dim0(x: torch.Tensor, group: dist.ProcessGroup, output_split_sizes: Optional[list[int]],
                     input_split_sizes: Optional[list[int]]) -> torch.Tensor:
    """Rows input_split_sizes[i] of `x` go to rank i; rows output_split_sizes[i] come from rank i
    (None: equal parts)."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    rows = x.size(0) if output_split_sizes is None else sum(output_split_sizes)
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes,
                           group=group)
    return out


def _check_split_sizes(what: str, sizes: list[int], group: dist.ProcessGroup) -> None:
    if len(sizes) != dist.get_world_size(group) or any(not isinstance(n, int) or n < 0 for n in sizes):
        raise ValueError(f"{what} must be {dist.get_world_size(group)} non-negative ints (one per rank of the "
                         f"group), got {sizes!r}")


def _all_gather_dim0_uneven(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's rows (rank i holds sizes[i]) in rank order. gloo has no uneven all-gather:
    an all-to-all that sends this rank's rows to every rank moves the same bytes."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    if x.size(0) != sizes[dist.get_rank(group)]:
        raise ValueError(f"this rank holds {x.size(0)} rows but output_split_sizes says "
                         f"{sizes[dist.get_rank(group)]}")
    repeated = x.contiguous().unsqueeze(0).expand(world_size, *x.shape).reshape(-1, *x.shape[1:])
    return _all_to_all_dim0(repeated, group, list(sizes), [x.size(0)] * world_size)


def _reduce_scatter_dim0_uneven(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows sizes[i] of the sum over ranks of `x` to rank i: an all-to-all of the parts, then the
    sum in rank order (the same on every rank, whatever the backend)."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x
    if x.size(0) != sum(sizes):
        raise ValueError(f"the input has {x.size(0)} rows but input_split_sizes sum to {sum(sizes)}")
    mine = sizes[dist.get_rank(group)]
    parts = _all_to_all_dim0(x, group, [mine] * world_size, list(sizes))
    return parts.view(world_size, mine, *x.shape[1:]).sum(dim=0)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad, group, split_sizes):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        ctx.split_sizes = split_sizes
        if split_sizes is not None:
            return _all_gather_dim0_uneven(x, split_sizes, group)
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        # A gathered input that feeds tensor-parallel compute gets partial
        # gradients on every rank: they are summed while being scattered.
        if ctx.split_sizes is not None:
            if ctx.tensor_parallel_output_grad:
                return _reduce_scatter_dim0_uneven(grad, ctx.split_sizes, ctx.group), None, None, None
            start = sum(ctx.split_sizes[:dist.get_rank(ctx.group)])
            return grad[start:start + ctx.split_sizes[dist.get_rank(ctx.group)]].contiguous(), None, None, None
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_dim0(grad, ctx.group), None, None, None
        return _split_along_dim(grad, 0, ctx.group), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, split_sizes):
        ctx.group = group
        ctx.split_sizes = split_sizes
        if split_sizes is not None:
            return _reduce_scatter_dim0_uneven(x, split_sizes, group)
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.split_sizes is not None:
            return _all_gather_dim0_uneven(grad, ctx.split_sizes, ctx.group), None, None
        return _all_gather_dim0(grad, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return _all_to_all_dim0(x, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx, grad):
        # The adjoint sends every row back where it came from.
        return None, _AllToAll.apply(ctx.group, grad, ctx.input_split_sizes, ctx.output_split_sizes), None, None


def copy_to_tensor_model_parallel_region(input_, group=None):
    """Identity forward; all-reduce of the gradient over the TP group in backward."""
    return _CopyToModelParallelRegion.apply(input_, _tp_group(group))


def reduce_from_tensor_model_parallel_region(input_, group=None):
    """All-reduce forward; identity backward."""
    return _ReduceFromModelParallelRegion.apply(input_, _tp_group(group))


def scatter_to_tensor_model_parallel_region(input_, group=None):
    """Keep this rank's chunk of the last dimension; all-gather it back in backward."""
    return _ScatterToModelParallelRegion.apply(input_, _tp_group(group))


def gather_from_tensor_model_parallel_region(input_, group=None):
    """All-gather along the last dimension; split in backward."""
    return _GatherFromModelParallelRegion.apply(input_, _tp_group(group))


def scatter_to_sequence_parallel_region(input_, group=None):
    """Keep this rank's chunk of dimension 0 (the sequence); all-gather in backward."""
    return _ScatterToSequenceParallelRegion.apply(input_, _tp_group(group))


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None,
                                         output_split_sizes=None, use_global_buffer=False):
    """All-gather dimension 0; reduce-scatter (or split) the gradient in backward.
    `output_split_sizes` (host ints, one per rank): rank i contributes that many rows (uneven)."""
    group = _tp_group(group)
    if output_split_sizes is not None:
        output_split_sizes = [int(n) for n in output_split_sizes]
        _check_split_sizes("output_split_sizes", output_split_sizes, group)
    return _GatherFromSequenceParallelRegion.apply(input_, tensor_parallel_output_grad, group, output_split_sizes)


def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None,
                                               use_global_buffer=False):
    """Reduce-scatter dimension 0; all-gather the gradient in backward.
    `input_split_sizes` (host ints, one per rank): rank i gets that many rows of the sum (uneven)."""
    group = _tp_group(group)
    if input_split_sizes is not None:
        input_split_sizes = [int(n) for n in input_split_sizes]
        _check_split_sizes("input_split_sizes", input_split_sizes, group)
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group, input_split_sizes)


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, use_nccl_stream=False):
    """Megatron's all-to-all over `group` along dimension 0 (host-int split sizes, one per rank;
    None: equal parts); backward sends each gradient row back to where its row came from."""
    if group is None:
        raise ValueError("all_to_all: group must be a process group, got None")
    if use_nccl_stream:
        raise NotImplementedError("all_to_all: use_nccl_stream=True is not supported (one stream here)")
    sizes = []
    for what, split in (("output_split_sizes", output_split_sizes_), ("input_split_sizes", input_split_sizes)):
        split = None if split is None else [int(n) for n in split]
        if split is not None:
            _check_split_sizes(what, split, group)
        sizes.append(split)
    return _AllToAll.apply(group, input_, *sizes)
