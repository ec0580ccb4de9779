"""GPTModel: embedding -> TransformerBlock -> vocab-parallel output layer."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ... import parallel_state
from ...fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from ...tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ...tensor_parallel.layers import ColumnParallelLinear
from ...tensor_parallel.mappings import scatter_to_sequence_parallel_region
from ...transformer.module import MegatronModule
from ...transformer.transformer_block import TransformerBlock
from ...transformer.utils import reject_unsupported_inputs
from ...utils import check_positive_int, split_for_cp_rank, transpose_first_two
from ..common.embeddings.language_model_embedding import LanguageModelEmbedding
from ..common.embeddings.rotary_pos_embedding import RotaryEmbedding, shield_rotary_angles
from .gpt_layer_specs import layer_class_from_spec


def _check_parallel_layout(config) -> None:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if config.tensor_model_parallel_size != tp:
        raise ValueError(
            f"config.tensor_model_parallel_size ({config.tensor_model_parallel_size}) differs from "
            f"the initialized tensor-parallel size ({tp})"
        )
    cp = parallel_state.get_context_parallel_world_size()
    if config.context_parallel_size != cp:
        raise ValueError(
            f"config.context_parallel_size ({config.context_parallel_size}) differs from the initialized "
            f"context-parallel size ({cp})"
        )


class GPTModel(MegatronModule):
    def __init__(
        self,
        config,
        transformer_layer_spec=None,
        vocab_size: int = None,
        max_sequence_length: int = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        mtp_block_spec=None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config)
        for name, value in (("vocab_size", vocab_size), ("max_sequence_length", max_sequence_length)):
            check_positive_int(name, value, "GPTModel")
        if not (pre_process and post_process):
            raise NotImplementedError("pre_process/post_process=False (pipeline stages) is not supported")
        if mtp_block_spec is not None:
            raise NotImplementedError("multi-token prediction (mtp_block_spec) is not supported")
        if vp_stage not in (None, 0):
            raise NotImplementedError(f"vp_stage={vp_stage!r}: virtual pipelining is not supported")
        _check_parallel_layout(config)
        layer_class_from_spec(transformer_layer_spec)  # a bad spec fails before anything is built
        # config.fp8 takes effect through megatron_fsdp.fp8.convert_to_fp8 (the FSDP plan applies it),
        # which sets this; forward refuses to run fp8 layers in high precision silently.
        self.fp8_converted = False

        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type

        meta = torch.device("meta") if config.init_model_with_meta_device else contextlib.nullcontext()
        with meta:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type,
                scatter_to_sequence_parallel=scatter_embedding_sequence_parallel)
            if position_embedding_type == "rope":
                self.rotary_pos_emb = RotaryEmbedding(
                    config.kv_channels, rotary_percent, config.rotary_interleaved,
                    seq_len_interpolation_factor, rotary_base, rope_scaling, rope_scaling_factor)
            else:
                self.rotary_pos_emb = None
            self.decoder = TransformerBlock(config, spec=transformer_layer_spec)
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method,
                bias=False, skip_bias_add=False, gather_output=not parallel_output,
                skip_weight_param_allocation=share_embeddings_and_output_weights,
                tp_comm_buffer_name="lm_head")

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        if self.share_embeddings_and_output_weights:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def set_input_tensor(self, input_tensor) -> None:
        if input_tensor not in (None, [None]):
            raise NotImplementedError("pipeline parallelism (set_input_tensor) is not supported")

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        decoder_input: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        extra_block_kwargs: Optional[dict] = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params=None,
        loss_mask: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        output_processor=None,
        output_processor_context=None,
    ) -> torch.Tensor:
        """Per-token loss [b, s] when `labels` are given, else logits [b, s, vocab/tp]
        ([b, s, vocab] with parallel_output=False). Megatron-Core 0.19's signature.

        As in Megatron-Core, `loss_mask` is not applied here: the caller's loss
        function weights the returned per-token loss. `padding_mask` ([b, s],
        True = padding) reaches the layers as in Megatron, where only
        mixture-of-experts routing reads it (see MLP.forward).
        """
        if getattr(self.config, "fp8", None) is not None and not self.fp8_converted:
            raise RuntimeError(
                f"GPTModel: config.fp8={self.config.fp8!r} but its linears were not converted to fp8: wrap the "
                "model with TorchFullyShardedDataParallel, or call megatron_fsdp.fp8.convert_to_fp8(model)")
        reject_unsupported_inputs(
            "GPTModel.forward", inference_context=inference_context, inference_params=inference_params,
            packed_seq_params=packed_seq_params, output_processor=output_processor,
            output_processor_context=output_processor_context)
        if (extra_block_kwargs or {}).get("extract_layer_indices"):
            raise ValueError("GPTModel.forward: extract_layer_indices in extra_block_kwargs is not supported "
                             "(the decoder would return intermediate states instead of one tensor); "
                             "call model.decoder with it instead")
        if decoder_input is None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, sequence], got shape {tuple(input_ids.shape)}")
            tp = parallel_state.get_tensor_model_parallel_world_size()
            if self.config.sequence_parallel and input_ids.size(1) % tp != 0:
                raise ValueError(
                    f"sequence length {input_ids.size(1)} is not divisible by the tensor-parallel "
                    f"size {tp}, as sequence_parallel requires"
                )
            if padding_mask is not None and padding_mask.shape != input_ids.shape:
                raise ValueError(f"padding_mask has shape {tuple(padding_mask.shape)}, expected input_ids' "
                                 f"shape {tuple(input_ids.shape)}")
            decoder_input = self.embedding(input_ids, position_ids)
            if padding_mask is not None and self.config.sequence_parallel:
                # Each TP rank keeps the mask of its own tokens, as Megatron does.
                padding_mask = scatter_to_sequence_parallel_region(
                    padding_mask.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        rotary_pos_emb = None
        if self.rotary_pos_emb is not None:
            cp = parallel_state.get_context_parallel_world_size()
            seq_len = decoder_input.size(0) * cp * (
                parallel_state.get_tensor_model_parallel_world_size() if self.config.sequence_parallel else 1)
            # The whole sequence's angles, then this CP rank's chunks (Megatron's get_pos_emb_on_this_cp_rank).
            angles = split_for_cp_rank(self.rotary_pos_emb(seq_len), 0, cp,
                                       parallel_state.get_context_parallel_rank() if cp > 1 else 0)
            # fp32 angles, shielded from FSDP's mixed-precision cast of the layers' inputs.
            rotary_pos_emb = shield_rotary_angles(angles)
        hidden_states = self.decoder(decoder_input, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                     padding_mask=padding_mask, **(extra_block_kwargs or {}))
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if labels is None:
            logits, _ = self.output_layer(hidden_states, weight=weight,
                                          runtime_gather_output=runtime_gather_output)
            return transpose_first_two(logits)
        # The loss needs vocabulary-parallel logits whatever parallel_output says.
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=False)
        return self.compute_language_model_loss(labels, logits)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """labels [b, s], vocab-parallel logits [s, b, v/tp] -> loss [b, s]."""
        labels = labels.transpose(0, 1).contiguous()
        if self.config.cross_entropy_loss_fusion:  # fp32 arithmetic on the logits as they are
            loss = fused_vocab_parallel_cross_entropy(logits, labels)
        else:
            if not self.fp16_lm_cross_entropy:
                logits = logits.float()
            loss = vocab_parallel_cross_entropy(logits, labels)
        return transpose_first_two(loss)
