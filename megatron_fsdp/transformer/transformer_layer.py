"""Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention import SelfAttention
from .enums import AttnMaskType
from .mlp import MLP
from .moe.moe_config import is_moe_layer
from .norms import build_norm
from .utils import reject_unsupported_inputs
from ..utils import triton_kernels_for


def _kernels_for(x: torch.Tensor):
    """triton_bias_dropout_add for a CUDA tensor where Triton is installed, else None (the eager path)."""
    return triton_kernels_for(x, "megatron_fsdp.transformer.triton_bias_dropout_add")


class FusedBiasDropoutAdd(torch.autograd.Function):
    """residual + dropout(x + bias) in fp32, rounded once, by triton_bias_dropout_add's kernels."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float) -> torch.Tensor:
        # The mask's seed, from the device's generator (its state decides the mask, as F.dropout's).
        seed = (torch.randint(0, 2 ** 62, (1,), device=x.device, dtype=torch.int64) if p > 0 else
                torch.empty(1, device=x.device, dtype=torch.int64))
        ctx.save_for_backward(seed)
        ctx.p, ctx.x_dtype, ctx.bias_dtype = p, x.dtype, None if bias is None else bias.dtype
        return _kernels_for(x).bias_dropout_add_fwd(x, bias, residual, seed, p)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (seed,) = ctx.saved_tensors
        bias_grad = ctx.bias_dtype is not None and ctx.needs_input_grad[1]
        # With a bias to train, x's gradient in fp32 first: the bias's is its sum over the tokens
        # before any rounding, as the eager path's autograd sums it.
        dx = _kernels_for(grad_output).bias_dropout_add_bwd(grad_output, seed, ctx.p,
                                                            torch.float32 if bias_grad else ctx.x_dtype)
        dbias = None
        if bias_grad:
            dbias = dx.sum(dim=tuple(range(dx.dim() - 1))).to(ctx.bias_dtype)
            dx = dx.to(ctx.x_dtype)
        return dx, dbias, grad_output, None


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                     prob: float, training: bool, fused: bool = False) -> torch.Tensor:
    """residual + dropout(x + bias), as Megatron's bias-dropout-add.

    fused=False is Megatron's unfused function: each op rounds to the input
    dtype. fused=True (bias_dropout_fusion) is its compiled kernel
    (`torch.compile`), which computes in fp32 and rounds once; that changes
    bf16/fp16 results in the last bit, not fp32 ones. On CUDA the fused
    function is one Triton kernel each way (triton_bias_dropout_add.py), its
    masks drawn by Philox from a seed the device's generator gives; on the
    CPU it runs as fp32 ops with F.dropout. (Megatron's compiled kernel draws
    its masks with its own generator too, so no implementation reproduces its
    masks bit for bit.)
    """
    if fused:
        if _kernels_for(x) is not None:  # one kernel each way (triton_bias_dropout_add.py)
            return FusedBiasDropoutAdd.apply(x, bias, residual, prob if training else 0.0)
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
        if is_moe_layer(config, layer_number):
            from .moe.moe_layer import MoELayer  # NOTE: here: dense models do not import the MoE modules

            self.mlp = MoELayer(config, layer_number=layer_number)
        else:
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
