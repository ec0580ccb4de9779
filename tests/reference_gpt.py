"""A dense, single-process GPT written from scratch in plain PyTorch.

It shares no code with megatron_fsdp: it reads the full weights (by
megatron_fsdp's parameter names and layouts) and computes the same function
batch-first, with explicit softmax attention. Tests compare the parallel model
against it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _norm(x, params, prefix, cfg):
    w = params[prefix + ".weight"]
    if cfg.layernorm_zero_centered_gamma:
        w = w + 1
    if cfg.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * w
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + cfg.layernorm_epsilon) * w + params[prefix + ".bias"]


def _linear(x, params, prefix):
    return F.linear(x, params[prefix + ".weight"], params.get(prefix + ".bias"))


def _rope(x, positions, dim, base):
    """x [b, heads, s, hn]: rotate the first `dim` channels (rotate-half convention)."""
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    x_rot, x_pass = x[..., :dim], x[..., dim:]
    x1, x2 = x_rot[..., : dim // 2], x_rot[..., dim // 2:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, x_pass], dim=-1)


def attention(x, params, prefix, cfg, rope_dim=None, rope_base=10000, attention_mask=None):
    b, s, _ = x.shape
    heads, groups, hn = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    per_group = heads // groups
    qkv = _linear(x, params, prefix + ".linear_qkv").view(b, s, groups, per_group + 2, hn)
    q = qkv[:, :, :, :per_group].reshape(b, s, heads, hn).transpose(1, 2)
    k = qkv[:, :, :, per_group].transpose(1, 2)
    v = qkv[:, :, :, per_group + 1].transpose(1, 2)
    if cfg.qk_layernorm:
        q = _norm(q, params, prefix + ".q_layernorm", cfg)
        k = _norm(k, params, prefix + ".k_layernorm", cfg)
    if rope_dim:
        positions = torch.arange(s)
        q, k = _rope(q, positions, rope_dim, rope_base), _rope(k, positions, rope_dim, rope_base)
    k = k.repeat_interleave(per_group, dim=1)
    v = v.repeat_interleave(per_group, dim=1)
    scale = cfg.softmax_scale if cfg.softmax_scale is not None else 1.0 / math.sqrt(hn)
    scores = (q @ k.transpose(-1, -2)) * scale
    masked = torch.ones(s, s, dtype=torch.bool).triu(1)
    if attention_mask is not None:  # Megatron's convention: True = masked out
        masked = masked | attention_mask
    # Megatron's attention_mask_func: masked scores become -10000 (a fully masked row is uniform).
    scores = scores.masked_fill(masked, -10000.0)
    context = scores.softmax(-1) @ v  # [b, heads, s, hn]
    return _linear(context.transpose(1, 2).reshape(b, s, heads * hn), params, prefix + ".linear_proj")


def mlp(x, params, prefix, cfg):
    h = _linear(x, params, prefix + ".linear_fc1")
    if cfg.gated_linear_unit:
        gate, up = h.chunk(2, dim=-1)  # fc1's full weight is [gate; up]
        h = cfg.activation_func(gate) * up
    else:
        h = cfg.activation_func(h)
    return _linear(h, params, prefix + ".linear_fc2")


def transformer_layer(x, params, prefix, cfg, rope_dim=None, rope_base=10000, attention_mask=None):
    x = x + attention(_norm(x, params, prefix + ".input_layernorm", cfg), params,
                      prefix + ".self_attention", cfg, rope_dim, rope_base, attention_mask)
    return x + mlp(_norm(x, params, prefix + ".pre_mlp_layernorm", cfg), params, prefix + ".mlp", cfg)


def gpt_forward(params, cfg, input_ids, labels, *, position_embedding_type="learned_absolute",
                tied=False, rotary_percent=1.0, rotary_base=10000, attention_mask=None):
    """Per-token loss [b, s] (fp32)."""
    b, s = input_ids.shape
    x = F.embedding(input_ids, params["embedding.word_embeddings.weight"])
    rope_dim = None
    if position_embedding_type == "learned_absolute":
        x = x + params["embedding.position_embeddings.weight"][:s][None]
    elif position_embedding_type == "rope":
        rope_dim = int(cfg.kv_channels * rotary_percent)
    for i in range(cfg.num_layers):
        x = transformer_layer(x, params, f"decoder.layers.{i}", cfg, rope_dim, rotary_base, attention_mask)
    x = _norm(x, params, "decoder.final_layernorm", cfg)
    out_w = params["embedding.word_embeddings.weight" if tied else "output_layer.weight"]
    logits = F.linear(x, out_w).float()
    return F.cross_entropy(logits.reshape(b * s, -1), labels.reshape(-1), reduction="none").view(b, s)
