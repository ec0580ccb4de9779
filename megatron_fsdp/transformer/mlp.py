"""MLP: column-parallel fc1, activation (optionally gated), row-parallel fc2."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .fused_activations import bias_activation, weighted_swiglu


class MLP(nn.Module):
    """With gated_linear_unit, fc1 computes a gate and an up projection, and
    each TP rank holds Megatron-Core's layout: its units' gate rows, then their
    up rows ([gate_r; up_r]), so the output splits in halves with a view.
    fc1 is a ColumnParallelLinear with Megatron's stride 2: its full weight is
    [gate; up] at every TP size (tensor_parallel.partition_stride), which is
    what initialization draws, checkpoints store and export writes.
    """

    def __init__(self, config, input_size: int | None = None):
        super().__init__()
        self.config = config
        self.input_size = config.hidden_size if input_size is None else input_size
        ffn = config.ffn_hidden_size
        self.gated = config.gated_linear_unit
        self.activation_func = config.activation_func
        self.linear_fc1 = ColumnParallelLinear(
            self.input_size, 2 * ffn if self.gated else ffn, config=config,
            init_method=config.init_method, bias=config.add_bias_linear, gather_output=False,
            stride=2 if self.gated else 1,
            skip_bias_add=True, tp_comm_buffer_name="fc1")
        self.linear_fc2 = RowParallelLinear(
            ffn, config.hidden_size, config=config, init_method=config.output_layer_init_method,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            tp_comm_buffer_name="fc2")

    def _fused_activation(self, intermediate, bias, per_token_scale):
        """Megatron's bias_activation_fusion paths (see fused_activations)."""
        if per_token_scale is not None:
            # Megatron fuses the token weighting for SwiGLU only, and without a bias.
            if not (self.activation_func is F.silu and self.gated):
                raise ValueError("MLP: with bias_activation_fusion, per_token_scale needs SwiGLU "
                                 f"(activation_func=F.silu, gated_linear_unit=True), got "
                                 f"{getattr(self.activation_func, '__name__', self.activation_func)}, "
                                 f"gated_linear_unit={self.gated}")
            if bias is not None:
                raise NotImplementedError("MLP: per_token_scale with bias_activation_fusion and an fc1 bias "
                                          "is not supported (as in Megatron-Core); set add_bias_linear=False")
            return weighted_swiglu(intermediate, per_token_scale.unsqueeze(-1))
        kind = ("geglu" if self.gated else "gelu") if self.activation_func is F.gelu else "swiglu"
        return bias_activation(intermediate, bias, kind)

    def forward(self, hidden_states: torch.Tensor, per_token_scale: Optional[torch.Tensor] = None, *,
                padding_mask: Optional[torch.Tensor] = None):
        """[s, b, h] -> (output [s, b, h], bias of fc2 or None).

        Megatron-Core's signature. `per_token_scale` ([s, b]) multiplies each
        token's activations before fc2; under sequence parallelism it covers
        the whole sequence, which fc1 gathers. `padding_mask` only steers
        mixture-of-experts routing in Megatron-Core; a dense MLP, there as
        here, computes every token the same way, so it does not change the result.
        """
        if per_token_scale is not None:
            tokens = list(hidden_states.shape[:-1])
            if self.config.sequence_parallel:
                tokens[0] *= parallel_state.get_tensor_model_parallel_world_size()
            if list(per_token_scale.shape) != tokens:
                raise ValueError(f"MLP.forward: per_token_scale has shape {tuple(per_token_scale.shape)}, "
                                 f"expected one scale per token of fc1's output {tuple(tokens)}")
        intermediate, bias = self.linear_fc1(hidden_states)
        if self.config.bias_activation_fusion:
            intermediate = self._fused_activation(intermediate, bias, per_token_scale)
        else:
            if bias is not None:
                intermediate = intermediate + bias
            if self.gated:
                gate, up = torch.chunk(intermediate, 2, dim=-1)
                intermediate = self.activation_func(gate) * up
            else:
                intermediate = self.activation_func(intermediate)
            if per_token_scale is not None:
                intermediate = (intermediate * per_token_scale.unsqueeze(-1)).to(intermediate.dtype)
        return self.linear_fc2(intermediate)
