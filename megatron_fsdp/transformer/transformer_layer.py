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
from .utils import reject_unsupported_inputs


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                     prob: float, training: bool, fused: bool = False) -> torch.Tensor:
    """residual + dropout(x + bias), as Megatron's bias-dropout-add.

    fused=False is Megatron's unfused function: each op rounds to the input
    dtype. fused=True (bias_dropout_fusion) is its compiled kernel
    (`torch.compile`), which computes in fp32 and rounds once; that changes
    bf16/fp16 results in the last bit, not fp32 ones. (Dropout masks come from
    the RNG either way; Megatron's compiled kernel draws them with its own
    generator, so no implementation reproduces its masks bit for bit.)
    """
    if fused:
        out = x.float() if bias is None else x.float() + bias.float()
        return (residual.float() + F.dropout(out, p=prob, training=training)).to(residual.dtype)
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
                context=None, context_mask=None, rotary_pos_emb: Optional[torch.Tensor] = None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None,
                padding_mask: Optional[torch.Tensor] = None, *, inference_params=None):
        """[s, b, h] -> (output [s, b, h], context): Megatron-Core 0.19's
        signature; the arguments of features megatron_fsdp lacks must be None.
        `padding_mask` goes to the MLP, as in Megatron (see MLP.forward)."""
        reject_unsupported_inputs(
            "TransformerLayer.forward", context=context, context_mask=context_mask, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset, inference_params=inference_params)
        attention_output, attention_bias = self.self_attention(
            self.input_layernorm(hidden_states), attention_mask, rotary_pos_emb=rotary_pos_emb)
        hidden_states = bias_dropout_add(attention_output, attention_bias, hidden_states,
                                         self.hidden_dropout, self.training, self.config.bias_dropout_fusion)
        mlp_output, mlp_bias = self.mlp(self.pre_mlp_layernorm(hidden_states), padding_mask=padding_mask)
        hidden_states = bias_dropout_add(mlp_output, mlp_bias, hidden_states,
                                         self.hidden_dropout, self.training, self.config.bias_dropout_fusion)
        return hidden_states, None
