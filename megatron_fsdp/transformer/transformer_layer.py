"""Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention import SelfAttention
from .enums import AttnMaskType
from .mlp import MLP
from .norms import build_norm


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                     prob: float, training: bool) -> torch.Tensor:
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


class TransformerLayer(nn.Module):
    """Megatron-Core's local-spec layer. forward returns (hidden_states, context)
    as Megatron's does; context is always None (no cross-attention)."""

    def __init__(self, config, submodules=None, layer_number: int = 1,
                 hidden_dropout: Optional[float] = None):
        super().__init__()
        if submodules is not None:
            raise NotImplementedError(
                "TransformerLayer submodules are fixed in megatron_fsdp; pass submodules=None"
            )
        self.config = config
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        # Under sequence parallelism each TP rank normalizes a part of the tokens.
        self.input_layernorm = build_norm(config, config.hidden_size, partial_grads=config.sequence_parallel)
        self.self_attention = SelfAttention(config, layer_number, AttnMaskType.causal)
        self.pre_mlp_layernorm = build_norm(config, config.hidden_size, partial_grads=config.sequence_parallel)
        self.mlp = MLP(config)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                rotary_pos_emb: Optional[torch.Tensor] = None, **unused):
        attention_output, attention_bias = self.self_attention(
            self.input_layernorm(hidden_states), attention_mask, rotary_pos_emb)
        hidden_states = bias_dropout_add(attention_output, attention_bias, hidden_states,
                                         self.hidden_dropout, self.training)
        mlp_output, mlp_bias = self.mlp(self.pre_mlp_layernorm(hidden_states))
        hidden_states = bias_dropout_add(mlp_output, mlp_bias, hidden_states,
                                         self.hidden_dropout, self.training)
        return hidden_states, None
