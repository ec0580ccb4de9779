"""broadcast_data: one TP rank's batch to its whole TP group (Megatron's)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import parallel_state

_MAX_DIMS = 8  # per tensor; Megatron's limit too


def broadcast_data(keys: list[str], data: dict[str, torch.Tensor] | None,
                   datatype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors `data[key]` of TP rank 0, on every rank of its TP group
    (on the model-parallel device). Only TP rank 0 reads `data`; every one of
    its tensors must have dtype `datatype`."""
    if not keys:
        return {}
    group = parallel_state.get_tensor_model_parallel_group()
    src = parallel_state.get_tensor_model_parallel_src_rank()
    device = parallel_state.get_device()
    is_src = parallel_state.get_tensor_model_parallel_rank() == 0
    # Shapes first, checked on the source: a bad batch raises on TP rank 0
    # before any data moves; the others see an empty shape table and raise too.
    shapes = torch.zeros(len(keys), _MAX_DIMS + 1, dtype=torch.int64)
    problem = ""
    if is_src:
        for i, key in enumerate(keys):
            t = data[key] if data is not None and key in data else None
            if t is None:
                problem = f"broadcast_data: key {key!r} is missing from the data"
            elif t.dtype != datatype:
                problem = f"broadcast_data: {key} has data type {t.dtype}, which is different than {datatype}"
            elif t.dim() > _MAX_DIMS:
                problem = f"broadcast_data: {key} has {t.dim()} dimensions, more than {_MAX_DIMS}"
            if problem:
                shapes.fill_(-1)
                break
            shapes[i, 0] = t.dim()
            shapes[i, 1:1 + t.dim()] = torch.tensor(t.shape)
    shapes = shapes.to(device)
    dist.broadcast(shapes, src, group=group)
    if (shapes < 0).any():
        raise ValueError(problem or "broadcast_data: tensor-parallel rank 0 rejected its data (see its error)")
    sizes = [tuple(int(d) for d in row[1:1 + int(row[0])]) for row in shapes.cpu()]
    numels = [int(torch.Size(size).numel()) for size in sizes]
    if is_src:
        flat = torch.cat([data[key].contiguous().view(-1).to(device) for key in keys])
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device)
    dist.broadcast(flat, src, group=group)
    return {key: part.view(size) for key, part, size in zip(keys, flat.split(numels), sizes)}
