"""DCP saves of tensors made only when they are written (checkpoint conversion).

The state dict handed to `dcp.save` holds a meta tensor for each such tensor:
its shape and dtype plan the checkpoint, and `produce(key)` makes the values
when DCP's writer asks for them, one tensor at a time, so a model never needs
its full size in memory.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.checkpoint import DefaultSavePlanner

from .core import CheckpointError


class LazySavePlanner(DefaultSavePlanner):
    """DCP's save planner; each meta tensor of the state dict is `produce(DCP key)`, checked
    against the meta tensor's shape and cast to its dtype."""

    def __init__(self, produce: Callable[[str], torch.Tensor]):
        super().__init__()
        self._produce = produce

    def lookup_object(self, index):
        found = super().lookup_object(index)
        if isinstance(found, torch.Tensor) and found.is_meta:
            return as_planned(index.fqn, self._produce(index.fqn), found.shape, found.dtype)
        return found


def as_planned(name: str, tensor: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` as the plan has it (on the CPU, in `dtype`), after checking its shape."""
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"{name}: produced shape {list(tensor.shape)}, expected {list(shape)}")
    return tensor.detach().to("cpu", dtype).contiguous()
