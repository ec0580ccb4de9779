"""Self-attention: fused QKV column-parallel projection, GQA, RoPE, torch SDPA.

Each TP rank owns num_query_groups / tp whole query groups, so attention runs
on local heads with no communication until the row-parallel output projection.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state
from ..models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from ..tensor_parallel import random as tp_random
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from .cp_attention import comm_type_of_layer, context_parallel_attention
from .enums import AttnMaskType
from .norms import build_norm
from .utils import reject_unsupported_inputs


class DotProductAttention(nn.Module):
    """softmax(q k^T * scale + mask) v on local heads, via F.scaled_dot_product_attention.

    `attention_mask` follows Megatron: a bool tensor broadcastable to
    [b, heads, s, s] where True means "masked out". With the causal mask type
    the causal mask is added to it (Megatron's GPT masks already contain it).

    Megatron's softmax (FusedScaleMaskSoftmax with attention_mask_func) fills
    masked scores with -10000 in fp32 rather than -inf. For a row with at
    least one visible key the two agree (exp(-10000 - max) is 0 in fp32); a
    row with every key masked (a padding query) becomes a uniform average of
    all values there, not zeros, and so it is here.
    """

    def __init__(self, config, layer_number: int = 1,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None):
        super().__init__()
        if attention_type != "self":
            raise NotImplementedError(f"attention_type={attention_type!r}: only 'self' is supported")
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = config.softmax_scale_value if softmax_scale is None else softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None,
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        """q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn]."""
        reject_unsupported_inputs("DotProductAttention.forward", attention_bias=attention_bias,
                                  packed_seq_params=packed_seq_params)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        if parallel_state.get_context_parallel_world_size() > 1:
            return self._context_parallel(q, k, v, attention_mask, mask_type)
        seq = q.size(2)
        is_causal = mask_type == AttnMaskType.causal
        allowed = None
        if attention_mask is not None and mask_type != AttnMaskType.no_mask:
            allowed = ~attention_mask.to(torch.bool)
            if is_causal:
                causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
                allowed = allowed & causal
                is_causal = False
        if allowed is not None:
            # A fully masked row: all scores equal (-10000 in Megatron) -> uniform
            # probabilities. A zero query gives all-zero scores, i.e. the same
            # uniform softmax, with dropout and gradients (none to q or k) as there.
            # (Unconditional: testing for such rows first would sync with the GPU.)
            fully_masked = ~allowed.any(-1, keepdim=True)
            q = q.masked_fill(fully_masked, 0.0)
            allowed = allowed | fully_masked
        dropout_p = self.dropout_p if self.training else 0.0
        # Dropout acts on this rank's heads: it draws from the TP-distinct stream
        # (under sequence parallelism the whole block already runs in that stream).
        rng = contextlib.nullcontext()
        if dropout_p > 0 and not self.config.sequence_parallel:
            rng = tp_random.get_cuda_rng_tracker().fork()
        with rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1))
        return out.permute(2, 0, 1, 3).flatten(2)

    def _context_parallel(self, q, k, v, attention_mask, mask_type) -> torch.Tensor:
        """This CP rank's queries (its two chunks of the sequence) over the whole sequence
        (cp_attention.py), causal: what Megatron's context parallelism computes."""
        if mask_type != AttnMaskType.causal or attention_mask is not None:
            raise NotImplementedError(
                "context parallelism runs causal attention without an explicit mask: an attention_mask "
                "(--reset-attention-mask, or a mask passed to the model) or a non-causal mask type is not "
                "supported with --context-parallel-size > 1")
        dropout_p = self.dropout_p if self.training else 0.0
        rng = contextlib.nullcontext()
        if dropout_p > 0 and not self.config.sequence_parallel:
            rng = tp_random.get_cuda_rng_tracker().fork()
        comm_type = comm_type_of_layer(self.config.cp_comm_type, self.layer_number) or "p2p"
        group = (parallel_state.get_hierarchical_context_parallel_groups() if comm_type == "a2a+p2p"
                 else parallel_state.get_context_parallel_group())
        with rng:
            out = context_parallel_attention(q, k, v, group, comm_type, scale=self.softmax_scale,
                                             dropout_p=dropout_p)
        return out.permute(2, 0, 1, 3).flatten(2)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number: int = 1,
                 attn_mask_type: AttnMaskType = AttnMaskType.causal):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.num_attention_heads_per_partition = config.num_attention_heads // tp
        self.num_query_groups_per_partition = config.num_query_groups // tp
        self.hidden_size_per_attention_head = config.kv_channels
        kv = config.kv_channels
        query_projection_size = config.num_attention_heads * kv
        qkv_size = query_projection_size + 2 * config.num_query_groups * kv
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, config=config, init_method=config.init_method,
            bias=config.add_bias_linear or config.add_qkv_bias, gather_output=False,
            skip_bias_add=False, tp_comm_buffer_name="qkv")
        self.core_attention = DotProductAttention(config, layer_number, attn_mask_type)
        self.linear_proj = RowParallelLinear(
            query_projection_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, tp_comm_buffer_name="proj")
        if config.qk_layernorm:
            # Each TP rank normalizes its own heads: weight gradients are partial.
            self.q_layernorm = build_norm(config, kv, partial_grads=tp > 1)
            self.k_layernorm = build_norm(config, kv, partial_grads=tp > 1)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.recompute_core_attention = (
            config.recompute_granularity == "selective" and "core_attn" in config.recompute_modules
        )

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor):
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        groups = self.num_query_groups_per_partition
        heads_per_group = self.num_attention_heads_per_partition // groups
        hn = self.hidden_size_per_attention_head
        # Megatron's fused layout: per query group, [its query heads, key, value].
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:2], groups, heads_per_group + 2, hn)
        query, key, value = mixed_qkv.split([heads_per_group, 1, 1], dim=3)
        query = query.reshape(*query.shape[:2], groups * heads_per_group, hn)
        return query, key.squeeze(3), value.squeeze(3)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                key_value_states=None, inference_context=None, rotary_pos_emb: Optional[torch.Tensor] = None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        """[s, b, h] -> (output [s, b, h], bias of the output projection or None).
        Megatron-Core 0.19's signature; the arguments of features
        megatron_fsdp lacks must be None."""
        reject_unsupported_inputs(
            "SelfAttention.forward", key_value_states=key_value_states, inference_context=inference_context,
            rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset, inference_params=inference_params)
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary_pos_emb is not None:
            query = apply_rotary_pos_emb(query, rotary_pos_emb, self.config)
            key = apply_rotary_pos_emb(key, rotary_pos_emb, self.config)
        if self.recompute_core_attention and self.training:
            context = tp_random.checkpoint(self.core_attention, False, query, key, value, attention_mask)
        else:
            context = self.core_attention(query, key, value, attention_mask)
        return self.linear_proj(context)
