"""Transformer building blocks with Megatron-Core's names."""

from .attention import DotProductAttention, SelfAttention
from .enums import AttnMaskType
from .mlp import MLP
from .norms import LayerNorm, RMSNorm
from .transformer_block import TransformerBlock
from .transformer_config import TransformerConfig
from .transformer_layer import TransformerLayer

__all__ = [
    "AttnMaskType",
    "DotProductAttention",
    "LayerNorm",
    "MLP",
    "RMSNorm",
    "SelfAttention",
    "TransformerBlock",
    "TransformerConfig",
    "TransformerLayer",
]
