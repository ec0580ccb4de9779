"""Convert GPT state dicts between megatron_fsdp's and Megatron-Core's fc1 layout.

With gated_linear_unit (SwiGLU, GeGLU), fc1 computes a gate and an up
projection for each of the ffn_hidden_size units:

- megatron_fsdp interleaves them row by row: gate_0, up_0, gate_1, up_1, ...
  (gate = W[0::2], up = W[1::2]). A TP rank's Shard(0) slice of that is the
  gate and up rows of its own units, so the full tensor is the same for every
  TP size and checkpoints reshard freely.
- Megatron-Core stores, on each TP rank, its units' gate rows then their up
  rows ([gate_r; up_r], `partition_stride` 2); its full tensor (the TP=N
  checkpoint's ranks concatenated) is [gate_0; up_0; gate_1; up_1; ...] by
  rank, and so depends on N.

Both give rank r the units [r * F / N, (r + 1) * F / N), matching fc2's
Shard(1) columns. Every other tensor (fused QKV included: per query group
[its query heads, key, value] in both) has the same layout in both, and is
passed through. The functions take full, plain tensors under megatron_fsdp's
parameter names (as `GPTModel.state_dict()` holds at TP=1, or
`DTensor.full_tensor()` of each).
"""

from __future__ import annotations

from typing import Mapping

import torch

from ...utils import check_positive_int

_FC1_SUFFIXES = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


def _check(name: str, tensor: torch.Tensor, tensor_model_parallel_size: int) -> None:
    tp = check_positive_int("tensor_model_parallel_size", tensor_model_parallel_size)
    rows = tensor.size(0)
    if rows % (2 * tp) != 0:
        raise ValueError(f"{name}: {rows} rows are not 2 (gate, up) x {tp} (TP ranks) whole blocks")


def fc1_to_megatron(tensor: torch.Tensor, tensor_model_parallel_size: int) -> torch.Tensor:
    """Interleaved (gate, up) rows -> Megatron's per-rank [gate; up] blocks, concatenated."""
    _check("fc1", tensor, tensor_model_parallel_size)
    gate, up = tensor[0::2], tensor[1::2]
    blocks = [torch.cat((g, u)) for g, u in zip(gate.chunk(tensor_model_parallel_size),
                                                 up.chunk(tensor_model_parallel_size))]
    return torch.cat(blocks)


def fc1_from_megatron(tensor: torch.Tensor, tensor_model_parallel_size: int) -> torch.Tensor:
    """Megatron's per-rank [gate; up] blocks -> interleaved (gate, up) rows."""
    _check("fc1", tensor, tensor_model_parallel_size)
    rows = []
    for block in tensor.chunk(tensor_model_parallel_size):
        gate, up = block.chunk(2)
        rows.append(torch.stack((gate, up), dim=1).flatten(0, 1))
    return torch.cat(rows)


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
    TP=`tensor_model_parallel_size` checkpoint holds (same names). Without
    gated_linear_unit the layouts agree and tensors pass through unchanged."""
    return _convert(state_dict, tensor_model_parallel_size, gated_linear_unit, fc1_to_megatron)


def from_megatron_layout(state_dict: Mapping[str, torch.Tensor], tensor_model_parallel_size: int, *,
                         gated_linear_unit: bool) -> dict[str, torch.Tensor]:
    """The inverse of `to_megatron_layout` (exact: rows are only reordered)."""
    return _convert(state_dict, tensor_model_parallel_size, gated_linear_unit, fc1_from_megatron)
