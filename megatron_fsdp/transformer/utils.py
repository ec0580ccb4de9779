"""Initialization helpers under Megatron-Core's names."""

from __future__ import annotations

import math

import torch


def init_method_normal(sigma: float):
    """N(0, sigma) initialization."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float, num_layers: int, multiplier: float = 2.0):
    """N(0, sigma / sqrt(multiplier * num_layers)): the output projections of residual branches."""
    std = sigma / math.sqrt(multiplier * num_layers)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_
