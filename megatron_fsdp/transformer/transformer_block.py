"""A stack of TransformerLayers with the final norm and activation recompute."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..tensor_parallel import random as tp_random
from .norms import build_norm
from ..models.common.embeddings.rotary_pos_embedding import shield_rotary_angles
from ..utils import reject_unsupported
from .spec_utils import layer_class_from_spec
from .utils import reject_unsupported_inputs


class TransformerBlock(nn.Module):
    def __init__(self, config, spec=None, post_layer_norm: bool = True, pre_process: bool = True,
                 post_process: bool = True, pg_collection=None, vp_stage: Optional[int] = None):
        """Megatron-Core 0.19's signature. `spec` names the layer class (a
        TransformerLayer subclass or a ModuleSpec of one; None: TransformerLayer).
        With pre_process=False the input comes from `set_input_tensor`, as
        for a pipeline stage in Megatron; post_process=False (or
        post_layer_norm=False) leaves out the final norm."""
        super().__init__()
        reject_unsupported("TransformerBlock", {
            "pg_collection": (pg_collection, None, "process groups come from parallel_state"),
        })
        if vp_stage not in (None, 0):
            raise NotImplementedError(f"TransformerBlock: vp_stage={vp_stage!r} is not supported by megatron_fsdp "
                                      "(only None or 0: no virtual pipelining)")
        layer_cls = layer_class_from_spec(spec, "TransformerBlock spec")
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.input_tensor = None
        self.layers = nn.ModuleList(layer_cls(config, layer_number=i + 1) for i in range(config.num_layers))
        self.final_layernorm = (
            build_norm(config, config.hidden_size, partial_grads=config.sequence_parallel)
            if post_layer_norm and post_process else None
        )

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """The input used instead of forward's `hidden_states` when pre_process=False."""
        self.input_tensor = input_tensor

    def _run_layers(self, start: int, end: int, extract: frozenset = frozenset(), padding_mask=None):
        """Layers [start, end) as one function returning (output, *outputs of the layers in `extract`)."""
        def run(hidden_states, attention_mask, rotary_pos_emb):
            kept = []
            for i in range(start, end):
                hidden_states, _ = self.layers[i](hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                                  padding_mask=padding_mask)
                if i in extract:
                    kept.append(hidden_states)
            return (hidden_states, *kept)

        return run

    def _checkpointed_forward(self, hidden_states, attention_mask, rotary_pos_emb, extract, padding_mask):
        config = self.config
        n = config.recompute_num_layers
        num_layers = len(self.layers)
        if config.recompute_method == "uniform":
            # Every chunk of n layers is recomputed as one unit.
            chunks = [(start, min(start + n, num_layers), True) for start in range(0, num_layers, n)]
        else:  # "block": the first n layers are recomputed one by one, the rest are not
            chunks = [(i, i + 1, i < n) for i in range(num_layers)]
        kept = []
        for start, end, recompute in chunks:
            run = self._run_layers(start, end, extract, padding_mask)
            if recompute:
                hidden_states, *more = tp_random.checkpoint(run, False, hidden_states, attention_mask, rotary_pos_emb)
            else:
                hidden_states, *more = run(hidden_states, attention_mask, rotary_pos_emb)
            kept += more
        return hidden_states, kept

    def _extract_indices(self, extract_layer_indices) -> frozenset:
        if extract_layer_indices is None:
            return frozenset()
        num_layers = len(self.layers)
        indices = list(extract_layer_indices) if isinstance(extract_layer_indices, (set, frozenset, list, tuple)) \
            else None
        if indices is None or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
                                      for i in indices):
            raise ValueError(f"extract_layer_indices must be a set of layer indices in [0, {num_layers}), "
                             f"got {extract_layer_indices!r}")
        return frozenset(indices)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                context=None, context_mask=None, rotary_pos_emb: Optional[torch.Tensor] = None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None,
                padding_mask: Optional[torch.Tensor] = None, extract_layer_indices=None, *,
                inference_params=None, dynamic_inference_decode_only=None):
        """Megatron-Core 0.19's signature; the arguments of features
        megatron_fsdp lacks must be None.

        Returns the output [s, b, h]; with a non-empty `extract_layer_indices`
        (0-based layer numbers), (output, [the output of each of those layers,
        before the final norm, in layer order]) as Megatron does.
        """
        reject_unsupported_inputs(
            "TransformerBlock.forward", context=context, context_mask=context_mask, rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
            inference_context=inference_context, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset, inference_params=inference_params,
            dynamic_inference_decode_only=dynamic_inference_decode_only)
        extract = self._extract_indices(extract_layer_indices)
        if not self.pre_process:
            if self.input_tensor is None:
                raise ValueError("TransformerBlock was built with pre_process=False: call set_input_tensor() "
                                 "with its input before forward")
            hidden_states = self.input_tensor
        if rotary_pos_emb is not None:
            rotary_pos_emb = shield_rotary_angles(rotary_pos_emb)
        # Under sequence parallelism every activation is split across TP ranks,
        # so all dropout in the block draws from the TP-distinct stream.
        rng = tp_random.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else contextlib.nullcontext()
        with rng:
            if self.config.recompute_granularity == "full" and self.training:
                hidden_states, kept = self._checkpointed_forward(hidden_states, attention_mask, rotary_pos_emb,
                                                                 extract, padding_mask)
            else:
                hidden_states, *kept = self._run_layers(0, len(self.layers), extract, padding_mask)(
                    hidden_states, attention_mask, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return (hidden_states, list(kept)) if extract else hidden_states
