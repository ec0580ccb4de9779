"""Convert full GPT state dicts to and from a Megatron-Core TP=N checkpoint's fc1.

With gated_linear_unit (SwiGLU, GeGLU), fc1 computes a gate and an up
projection for each of the ffn_hidden_size units. On each TP rank both
megatron_fsdp and Megatron-Core hold the rank's units' gate rows, then their
up rows ([gate_r; up_r]). A full state dict of megatron_fsdp (the model's
`state_dict()` at TP=1, or each parameter's full value:
tensor_parallel.partition_stride) holds fc1 as [gate; up] at every TP size;
Megatron-Core's TP=N checkpoint holds the ranks' blocks one after the other,
[gate_0; up_0; gate_1; up_1; ...], which depends on N.

Every other tensor (fused QKV included: per query group [its query heads,
key, value] in both) has the same layout in both, and is passed through.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ...tensor_parallel import partition_stride
from ...utils import check_positive_int

_FC1_SUFFIXES = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


def _check(name: str, tensor: torch.Tensor, tensor_model_parallel_size: int) -> None:
    tp = check_positive_int("tensor_model_parallel_size", tensor_model_parallel_size)
    rows = tensor.size(0)
    if rows % (2 * tp) != 0:
        raise ValueError(f"{name}: {rows} rows are not 2 (gate, up) x {tp} (TP ranks) whole blocks")


def fc1_to_megatron(tensor: torch.Tensor, tensor_model_parallel_size: int) -> torch.Tensor:
    """A full [gate; up] fc1 tensor -> Megatron's per-rank [gate_r; up_r] blocks, concatenated."""
    _check("fc1", tensor, tensor_model_parallel_size)
    return partition_stride.to_blocks(tensor, 2, tensor_model_parallel_size)


def fc1_from_megatron(tensor: torch.Tensor, tensor_model_parallel_size: int) -> torch.Tensor:
    """Megatron's per-rank [gate_r; up_r] blocks -> the full [gate; up] fc1 tensor."""
    _check("fc1", tensor, tensor_model_parallel_size)
    return partition_stride.from_blocks(tensor, 2, tensor_model_parallel_size)


def _convert(state_dict: Mapping[str, torch.Tensor], tensor_model_parallel_size: int,
             gated_linear_unit: bool, fn) -> dict[str, torch.Tensor]:
    if not isinstance(gated_linear_unit, bool):
        raise TypeError(f"gated_linear_unit must be a bool, got {gated_linear_unit!r}")
    out = {}
    for name, tensor in state_dict.items():
        if gated_linear_unit and name.endswith(_FC1_SUFFIXES):
            _check(name, tensor, tensor_model_parallel_size)
            out[name] = fn(tensor, tensor_model_parallel_size)
        else:
            out[name] = tensor
    return out


def to_megatron_layout(state_dict: Mapping[str, torch.Tensor], tensor_model_parallel_size: int, *,
                       gated_linear_unit: bool) -> dict[str, torch.Tensor]:
    """A full megatron_fsdp GPT state dict -> the full tensors a Megatron-Core
    TP=`tensor_model_parallel_size` checkpoint holds (same names). At TP=1, or
    without gated_linear_unit, the layouts agree and tensors pass through unchanged."""
    return _convert(state_dict, tensor_model_parallel_size, gated_linear_unit, fc1_to_megatron)


def from_megatron_layout(state_dict: Mapping[str, torch.Tensor], tensor_model_parallel_size: int, *,
                         gated_linear_unit: bool) -> dict[str, torch.Tensor]:
    """The inverse of `to_megatron_layout` (exact: rows are only reordered)."""
    return _convert(state_dict, tensor_model_parallel_size, gated_linear_unit, fc1_from_megatron)
