"""Initialization helpers under Megatron-Core's names."""

from __future__ import annotations

import math

import torch

from ..utils import reject_unsupported


def init_method_normal(sigma: float):
    """N(0, sigma) initialization."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    init_.normal_std = sigma  # (a meta-device model draws each rank's slice: megatron_fsdp.initialization)
    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """N(0, sigma / sqrt(multiplier * num_layers)): the output projections of residual branches."""
    std = sigma / math.sqrt(multiplier * num_layers)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    init_.normal_std = std
    return init_


def reject_unsupported_inputs(where: str, **inputs) -> None:
    """Megatron-Core's forward arguments for features megatron_fsdp lacks
    (packed sequences, cross-attention, inference caches, ...) are accepted
    by name, as Megatron code passes them, but a value other than None
    raises instead of being ignored."""
    reject_unsupported(where, {name: (value, None) for name, value in inputs.items()})
