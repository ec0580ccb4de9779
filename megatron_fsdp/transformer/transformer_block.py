"""A stack of TransformerLayers with the final norm and activation recompute."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..tensor_parallel import random as tp_random
from .norms import build_norm
from .transformer_layer import TransformerLayer
from .utils import reject_unsupported_inputs


class TransformerBlock(nn.Module):
    def __init__(self, config, spec=None, post_layer_norm: bool = True, pre_process: bool = True,
                 post_process: bool = True, layer_cls: type = TransformerLayer):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layer_cls(config, layer_number=i + 1) for i in range(config.num_layers))
        self.final_layernorm = (
            build_norm(config, config.hidden_size, partial_grads=config.sequence_parallel)
            if post_layer_norm and post_process else None
        )

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, attention_mask, rotary_pos_emb):
            for layer in self.layers[start:end]:
                hidden_states, _ = layer(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb)
            return hidden_states

        return run

    def _checkpointed_forward(self, hidden_states, attention_mask, rotary_pos_emb):
        config = self.config
        n = config.recompute_num_layers
        num_layers = len(self.layers)
        if config.recompute_method == "uniform":
            # Every chunk of n layers is recomputed as one unit.
            for start in range(0, num_layers, n):
                hidden_states = tp_random.checkpoint(
                    self._run_layers(start, min(start + n, num_layers)), False,
                    hidden_states, attention_mask, rotary_pos_emb)
        else:  # "block": the first n layers are recomputed one by one, the rest are not
            for i in range(num_layers):
                run = self._run_layers(i, i + 1)
                if i < n:
                    hidden_states = tp_random.checkpoint(run, False, hidden_states, attention_mask, rotary_pos_emb)
                else:
                    hidden_states = run(hidden_states, attention_mask, rotary_pos_emb)
        return hidden_states

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context=None, context_mask=None, rotary_pos_emb: Optional[torch.Tensor] = None,
                rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None) -> torch.Tensor:
        """Megatron-Core's signature; the arguments of features megatron_fsdp
        lacks must be None."""
        reject_unsupported_inputs(
            "TransformerBlock.forward", context=context, context_mask=context_mask, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias, inference_context=inference_context,
            packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
            inference_params=inference_params)
        # Under sequence parallelism every activation is split across TP ranks,
        # so all dropout in the block draws from the TP-distinct stream.
        rng = tp_random.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else contextlib.nullcontext()
        with rng:
            if self.config.recompute_granularity == "full" and self.training:
                hidden_states = self._checkpointed_forward(hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states = self._run_layers(0, len(self.layers))(hidden_states, attention_mask, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
