"""Hugging Face Llama-family weights <-> megatron_fsdp's GPT (full tensors, TP=1 names).

The mapping follows what the weights mean (issue 22's first part: the state dicts; the
checkpoint tool builds on it):

  model.embed_tokens.weight                 embedding.word_embeddings.weight (vocabulary rows
                                            padded with zeros on import, dropped on export)
  model.layers.i.input_layernorm.weight     decoder.layers.i.input_layernorm.weight
  model.layers.i.self_attn.{q,k,v}_proj     decoder.layers.i.self_attention.linear_qkv: per query
                                            group, its query heads, then its key, then its value
                                            (the order our attention reads); biases likewise (Qwen2)
  model.layers.i.self_attn.o_proj.weight    decoder.layers.i.self_attention.linear_proj.weight
  model.layers.i.post_attention_layernorm   decoder.layers.i.pre_mlp_layernorm.weight
  model.layers.i.mlp.{gate,up}_proj.weight  decoder.layers.i.mlp.linear_fc1.weight: [gate; up]
                                            (Megatron's full layout)
  model.layers.i.mlp.down_proj.weight       decoder.layers.i.mlp.linear_fc2.weight
  model.norm.weight                         decoder.final_layernorm.weight
  lm_head.weight                            output_layer.weight (absent when tied)

Rotary embeddings need no permutation: HF's `rotate_half` and Megatron's non-interleaved RoPE
rotate the same halves of each head; Llama 3.1's "llama3" scaling maps to `rope_scaling`. What
we cannot represent is refused by name.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def _rope(hf: Mapping) -> tuple[float, Mapping | None]:
    """(rope_theta, the scaling or None) from a config.json: its top-level `rope_theta` and
    `rope_scaling` (published checkpoints), or transformers 5's `rope_parameters`."""
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


# Llama 3.1's RoPE scaling as Megatron-Core parameterizes it: only the factor varies.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_scaling_factor(hf: Mapping) -> float | None:
    """The Llama-3.1 scaling factor of a config.json (None: plain RoPE); raises for others."""
    _, scaling = _rope(hf)
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    fixed = {k: scaling.get(k) for k in _LLAMA3_FIXED}
    if kind != "llama3" or any(fixed[k] is None or float(fixed[k]) != v for k, v in _LLAMA3_FIXED.items()):
        raise NotImplementedError(f"rope_scaling={dict(scaling)!r} is not supported: Llama-3.1's 'llama3' scaling "
                                  f"with {_LLAMA3_FIXED} (any factor) is")
    return float(scaling["factor"])


def check_hf_config(hf: Mapping) -> None:
    """Raise for a config.json whose model megatron_fsdp cannot represent, naming what."""
    archs = hf.get("architectures") or []
    if not archs or any(a not in ARCHITECTURES for a in archs):
        raise ValueError(f"Hugging Face architectures {archs}: supported are {', '.join(ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf['hidden_act']!r}: only SwiGLU ('silu') is supported")
    _rope_scaling_factor(hf)
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        raise NotImplementedError(f"sliding_window={hf['sliding_window']} (sliding-window attention) is not supported")
    if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
        raise NotImplementedError("attention_bias/mlp_bias on every projection are not supported (Qwen2's q/k/v "
                                  "biases are)")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise NotImplementedError(f"head_dim={head_dim} with {hf['num_attention_heads']} heads and hidden_size "
                                  f"{hf['hidden_size']}: a head size other than hidden/heads is not supported")


def gpt_arguments(hf: Mapping) -> tuple[dict, dict]:
    """(TransformerConfig fields, GPTModel keyword arguments) of the model a config.json describes."""
    check_hf_config(hf)
    qwen2 = "Qwen2ForCausalLM" in hf["architectures"]
    config = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), add_bias_linear=False, add_qkv_bias=qwen2,
        hidden_dropout=0.0, attention_dropout=0.0)
    factor = _rope_scaling_factor(hf)
    model = dict(vocab_size=hf["vocab_size"], max_sequence_length=hf.get("max_position_embeddings", 4096),
                 position_embedding_type="rope", rotary_base=int(_rope(hf)[0]), rope_scaling=factor is not None,
                 rope_scaling_factor=factor or 8.0,
                 share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)))
    return config, model


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """HF's separate projections -> per group [its query heads; key; value] (rows, or bias entries)."""
    d = q.shape[0] // heads
    per = heads // groups
    q = q.reshape(groups, per * d, *q.shape[1:])
    k = k.reshape(groups, d, *k.shape[1:])
    v = v.reshape(groups, d, *v.shape[1:])
    return torch.cat((q, k, v), dim=1).reshape(-1, *q.shape[2:])


def _split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = qkv.shape[0] // (heads + 2 * groups)
    per = heads // groups
    blocks = qkv.reshape(groups, (per + 2) * d, *qkv.shape[1:])
    q, k, v = blocks.split((per * d, d, d), dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < t.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the checkpoint's {t.shape[0]} rows")
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:]))) if rows > t.shape[0] else t


def hf_to_megatron_fsdp(hf_state: Mapping[str, torch.Tensor], hf: Mapping,
                        padded_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A Llama-family state dict (HF names) -> megatron_fsdp GPT's (full tensors, same dtype)."""
    config, model = gpt_arguments(hf)
    heads, groups = config["num_attention_heads"], config["num_query_groups"]
    rows = padded_vocab_size or hf["vocab_size"]
    out = {"embedding.word_embeddings.weight": _pad_rows(hf_state["model.embed_tokens.weight"], rows),
           "decoder.final_layernorm.weight": hf_state["model.norm.weight"]}
    if not model["share_embeddings_and_output_weights"]:
        out["output_layer.weight"] = _pad_rows(hf_state["lm_head.weight"], rows)
    for i in range(config["num_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf_state[src + "input_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = _qkv(
            hf_state[attn + "q_proj.weight"], hf_state[attn + "k_proj.weight"], hf_state[attn + "v_proj.weight"],
            heads, groups)
        if config["add_qkv_bias"]:
            out[dst + "self_attention.linear_qkv.bias"] = _qkv(
                hf_state[attn + "q_proj.bias"], hf_state[attn + "k_proj.bias"], hf_state[attn + "v_proj.bias"],
                heads, groups)
        out[dst + "self_attention.linear_proj.weight"] = hf_state[attn + "o_proj.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf_state[src + "post_attention_layernorm.weight"]
        gate, up = hf_state[src + "mlp.gate_proj.weight"], hf_state[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat((gate, up))
        out[dst + "mlp.linear_fc2.weight"] = hf_state[src + "mlp.down_proj.weight"]
    return out


def megatron_fsdp_to_hf(state: Mapping[str, torch.Tensor], hf: Mapping) -> dict[str, torch.Tensor]:
    """megatron_fsdp GPT's full state dict -> HF names, padded vocabulary rows dropped."""
    config, model = gpt_arguments(hf)
    heads, groups, vocab = config["num_attention_heads"], config["num_query_groups"], hf["vocab_size"]
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if not model["share_embeddings_and_output_weights"]:
        out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    for i in range(config["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        names = ("q_proj", "k_proj", "v_proj")
        for name, t in zip(names, _split_qkv(state[src + "self_attention.linear_qkv.weight"], heads, groups)):
            out[f"{dst}self_attn.{name}.weight"] = t
        if config["add_qkv_bias"]:
            for name, t in zip(names, _split_qkv(state[src + "self_attention.linear_qkv.bias"], heads, groups)):
                out[f"{dst}self_attn.{name}.bias"] = t
        out[dst + "self_attn.o_proj.weight"] = state[src + "self_attention.linear_proj.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        gate, up = state[src + "mlp.linear_fc1.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
        out[dst + "mlp.down_proj.weight"] = state[src + "mlp.linear_fc2.weight"]
    return {k: v.contiguous() for k, v in out.items()}
