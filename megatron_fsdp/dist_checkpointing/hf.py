"""Hugging Face Llama-family and mixture-of-experts weights <-> megatron_fsdp's GPT (full
tensors, TP=1 names).

The mapping follows what the weights mean (issue 22's first part: the state dicts; the
checkpoint tool builds on it):

  model.embed_tokens.weight                 embedding.word_embeddings.weight (vocabulary rows
                                            padded with zeros on import, dropped on export)
  model.layers.i.input_layernorm.weight     decoder.layers.i.input_layernorm.weight
  model.layers.i.self_attn.{q,k,v}_proj     decoder.layers.i.self_attention.linear_qkv: per query
                                            group, its query heads, then its key, then its value
                                            (the order our attention reads); biases likewise (Qwen2,
                                            Qwen2-MoE)
  model.layers.i.self_attn.{q,k}_norm       decoder.layers.i.self_attention.{q,k}_layernorm.weight
                                            (Qwen3-MoE's query/key norms)
  model.layers.i.self_attn.o_proj.weight    decoder.layers.i.self_attention.linear_proj.weight
  model.layers.i.post_attention_layernorm   decoder.layers.i.pre_mlp_layernorm.weight
  model.layers.i.mlp.{gate,up}_proj.weight  decoder.layers.i.mlp.linear_fc1.weight: [gate; up]
                                            (Megatron's full layout)
  model.layers.i.mlp.down_proj.weight       decoder.layers.i.mlp.linear_fc2.weight
  a layer with experts (Mixtral, Qwen2-MoE, Qwen3-MoE): hf_moe.py
  model.norm.weight                         decoder.final_layernorm.weight
  lm_head.weight                            output_layer.weight (absent when tied)

Rotary embeddings need no permutation: HF's `rotate_half` and Megatron's non-interleaved RoPE
rotate the same halves of each head; Llama 3.1's "llama3" scaling maps to `rope_scaling`. A
`head_dim` other than hidden / heads is our `kv_channels`. What we cannot represent is refused by
name.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from . import hf_moe

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ARCHITECTURES = DENSE_ARCHITECTURES + hf_moe.ARCHITECTURES


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
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):  # Qwen2-MoE writes 0 for none
        raise NotImplementedError(f"sliding_window={hf['sliding_window']} (sliding-window attention) is not supported")
    if hf.get("use_sliding_window"):
        raise NotImplementedError("use_sliding_window=True (sliding-window attention) is not supported")
    kinds = sorted(set(hf.get("layer_types") or ["full_attention"]) - {"full_attention"})
    if kinds:
        raise NotImplementedError(f"layer_types with {kinds}: only full attention is supported")
    if hf.get("attention_bias", False) or hf.get("mlp_bias", False):
        raise NotImplementedError("attention_bias/mlp_bias on every projection are not supported (Qwen2's q/k/v "
                                  "biases are)")
    if hf_moe.is_moe(hf):
        hf_moe.check_config(hf)


def _head_dim(hf: Mapping) -> int:
    """The head size: config.json's head_dim (None or absent: hidden / heads), as transformers reads it."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _qkv_bias(hf: Mapping) -> bool:
    archs = hf["architectures"]
    return "Qwen2ForCausalLM" in archs or (hf_moe.QWEN2_MOE in archs and bool(hf.get("qkv_bias", True)))


def _qk_norm(hf: Mapping) -> bool:
    return hf_moe.QWEN3_MOE in hf["architectures"]


def sparse_layers(hf: Mapping) -> list[int]:
    """1 for each layer with experts, 0 for a dense MLP."""
    return hf_moe.sparse_layers(hf) if hf_moe.is_moe(hf) else [0] * hf["num_hidden_layers"]


def gpt_arguments(hf: Mapping) -> tuple[dict, dict]:
    """(TransformerConfig fields, GPTModel keyword arguments) of the model a config.json describes."""
    check_hf_config(hf)
    config = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], kv_channels=_head_dim(hf),
        num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"], gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), add_bias_linear=False, add_qkv_bias=_qkv_bias(hf),
        qk_layernorm=_qk_norm(hf), hidden_dropout=0.0, attention_dropout=0.0)
    if hf_moe.is_moe(hf):
        config.update(hf_moe.config_fields(hf))
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
    """Our fused QKV (rows, or bias entries) -> HF's q, k, v."""
    d = qkv.shape[0] // (heads + 2 * groups)
    per = heads // groups
    blocks = qkv.reshape(groups, (per + 2) * d, *qkv.shape[1:])
    q, k, v = blocks.split((per * d, d, d), dim=1)
    return (q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:]))


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if rows < t.shape[0]:
        raise ValueError(f"padded vocabulary {rows} is smaller than the checkpoint's {t.shape[0]} rows")
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:]))) if rows > t.shape[0] else t


# A recipe: {output name: (input names, function of those tensors)}. Applied eagerly to a state
# dict, or one output at a time by tools/checkpoint/convert.py, which reads only its inputs.
Recipe = dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]]


def apply_recipe(recipe: Recipe, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: fn(*map(get, inputs)) for name, (inputs, fn) in recipe.items()}


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def hf_to_megatron_fsdp_recipe(hf: Mapping, padded_vocab_size: int | None = None) -> Recipe:
    """How each megatron_fsdp GPT tensor (full, TP=1 names) is made from HF's tensors."""
    config, model = gpt_arguments(hf)
    heads, groups = config["num_attention_heads"], config["num_query_groups"]
    rows = padded_vocab_size or hf["vocab_size"]
    pad = functools.partial(pad_rows, rows=rows)
    qkv = functools.partial(_qkv, heads=heads, groups=groups)
    out: Recipe = {"embedding.word_embeddings.weight": (("model.embed_tokens.weight",), pad)}
    for i, sparse in enumerate(sparse_layers(hf)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = ((src + "input_layernorm.weight",), _same)
        out[dst + "self_attention.linear_qkv.weight"] = (
            tuple(f"{attn}{n}_proj.weight" for n in "qkv"), qkv)
        if config["add_qkv_bias"]:
            out[dst + "self_attention.linear_qkv.bias"] = (tuple(f"{attn}{n}_proj.bias" for n in "qkv"), qkv)
        if config["qk_layernorm"]:
            for n in "qk":
                out[f"{dst}self_attention.{n}_layernorm.weight"] = ((f"{attn}{n}_norm.weight",), _same)
        out[dst + "self_attention.linear_proj.weight"] = ((attn + "o_proj.weight",), _same)
        out[dst + "pre_mlp_layernorm.weight"] = ((src + "post_attention_layernorm.weight",), _same)
        if sparse:
            out.update(hf_moe.layer_to_ours(hf, i))
            continue
        out[dst + "mlp.linear_fc1.weight"] = ((src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"),
                                              lambda gate, up: torch.cat((gate, up)))
        out[dst + "mlp.linear_fc2.weight"] = ((src + "mlp.down_proj.weight",), _same)
    out["decoder.final_layernorm.weight"] = (("model.norm.weight",), _same)
    if not model["share_embeddings_and_output_weights"]:
        out["output_layer.weight"] = (("lm_head.weight",), pad)
    return out


def megatron_fsdp_to_hf_recipe(hf: Mapping) -> Recipe:
    """How each HF tensor is made from megatron_fsdp GPT's (full, TP=1 names); padded
    vocabulary rows dropped."""
    config, model = gpt_arguments(hf)
    heads, groups, vocab = config["num_attention_heads"], config["num_query_groups"], hf["vocab_size"]

    def rows(t):
        return t[:vocab].contiguous()

    def qkv_part(k):
        return lambda t: _split_qkv(t, heads, groups)[k].contiguous()

    out: Recipe = {"model.embed_tokens.weight": (("embedding.word_embeddings.weight",), rows)}
    for i, sparse in enumerate(sparse_layers(hf)):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = ((src + "input_layernorm.weight",), _same)
        for k, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{dst}self_attn.{name}.weight"] = ((src + "self_attention.linear_qkv.weight",), qkv_part(k))
            if config["add_qkv_bias"]:
                out[f"{dst}self_attn.{name}.bias"] = ((src + "self_attention.linear_qkv.bias",), qkv_part(k))
        if config["qk_layernorm"]:
            for n in "qk":
                out[f"{dst}self_attn.{n}_norm.weight"] = ((f"{src}self_attention.{n}_layernorm.weight",), _same)
        out[dst + "self_attn.o_proj.weight"] = ((src + "self_attention.linear_proj.weight",), _same)
        out[dst + "post_attention_layernorm.weight"] = ((src + "pre_mlp_layernorm.weight",), _same)
        if sparse:
            out.update(hf_moe.layer_to_hf(hf, i))
            continue
        out[dst + "mlp.gate_proj.weight"] = ((src + "mlp.linear_fc1.weight",), lambda t: t.chunk(2)[0].contiguous())
        out[dst + "mlp.up_proj.weight"] = ((src + "mlp.linear_fc1.weight",), lambda t: t.chunk(2)[1].contiguous())
        out[dst + "mlp.down_proj.weight"] = ((src + "mlp.linear_fc2.weight",), _same)
    out["model.norm.weight"] = (("decoder.final_layernorm.weight",), _same)
    if not model["share_embeddings_and_output_weights"]:
        out["lm_head.weight"] = (("output_layer.weight",), rows)
    return out


def expected_shapes(hf: Mapping) -> dict[str, tuple[int, ...]]:
    """HF's tensors and the shapes config.json gives them (a source's are checked against these)."""
    heads, hidden, head = hf["num_attention_heads"], hf["hidden_size"], _head_dim(hf)
    groups, vocab, ffn = hf.get("num_key_value_heads") or heads, hf["vocab_size"], hf["intermediate_size"]
    out = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
           "model.norm.weight": (hidden,)}
    for i, sparse in enumerate(sparse_layers(hf)):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (heads * head, hidden),
                    p + "self_attn.k_proj.weight": (groups * head, hidden),
                    p + "self_attn.v_proj.weight": (groups * head, hidden),
                    p + "self_attn.o_proj.weight": (hidden, heads * head), p + "self_attn.q_norm.weight": (head,),
                    p + "self_attn.k_norm.weight": (head,), p + "input_layernorm.weight": (hidden,),
                    p + "post_attention_layernorm.weight": (hidden,)})
        if sparse:
            out.update(hf_moe.expected_shapes(hf, i))
        else:
            out.update({p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                        p + "mlp.down_proj.weight": (hidden, ffn)})
    return out


def hf_to_megatron_fsdp(hf_state: Mapping[str, torch.Tensor], hf: Mapping,
                        padded_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A state dict (HF names, as saved) -> megatron_fsdp GPT's (full tensors, same dtype)."""
    return apply_recipe(hf_to_megatron_fsdp_recipe(hf, padded_vocab_size), hf_state.__getitem__)


def megatron_fsdp_to_hf(state: Mapping[str, torch.Tensor], hf: Mapping) -> dict[str, torch.Tensor]:
    """megatron_fsdp GPT's full state dict -> HF names, padded vocabulary rows dropped."""
    return apply_recipe(megatron_fsdp_to_hf_recipe(hf), state.__getitem__)


def model_args(hf: Mapping) -> dict:
    """The pretraining flags (destination names) of the model a config.json describes: what
    a converted checkpoint stores for --use-checkpoint-args, and what convert.py prints."""
    config, model = gpt_arguments(hf)
    args = dict(
        num_layers=config["num_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["ffn_hidden_size"], num_attention_heads=config["num_attention_heads"],
        group_query_attention=config["num_query_groups"] != config["num_attention_heads"],
        num_query_groups=config["num_query_groups"],
        kv_channels=config["kv_channels"], swiglu=True, normalization="RMSNorm",
        norm_epsilon=config["layernorm_epsilon"], disable_bias_linear=True, add_qkv_bias=config["add_qkv_bias"],
        position_embedding_type="rope", rotary_base=model["rotary_base"], rotary_percent=1.0,
        use_rope_scaling=model["rope_scaling"], rope_scaling_factor=model["rope_scaling_factor"],
        max_position_embeddings=model["max_sequence_length"], seq_length=model["max_sequence_length"],
        untie_embeddings_and_output_weights=not model["share_embeddings_and_output_weights"])
    if config["qk_layernorm"]:
        args["qk_layernorm"] = True
    if hf_moe.is_moe(hf):
        args.update(hf_moe.model_args(hf))
    return args


def hf_config(args: Mapping, vocab_size: int, dtype: torch.dtype) -> dict:
    """The config.json of the model that pretraining flags `args` (destination names, as a
    checkpoint stores them) describe; raises for a model HF's Llama family (dense) or its
    mixture-of-experts architectures (hf_moe.py) cannot hold."""
    problems = [f"--{flag}" for flag, ok in (
        ("swiglu", args.get("swiglu")), ("normalization RMSNorm", args.get("normalization") == "RMSNorm"),
        ("position-embedding-type rope", args.get("position_embedding_type") == "rope"),
        ("disable-bias-linear", args.get("disable_bias_linear")),
        ("rotary-percent 1.0", args.get("rotary_percent", 1.0) == 1.0)) if not ok]
    moe = bool(args.get("num_experts"))
    if args.get("qk_layernorm") and not moe:
        problems.append("no --qk-layernorm (query/key norms: Qwen3-MoE only)")
    if problems:
        raise NotImplementedError(f"a Hugging Face {'MoE' if moe else 'Llama-family'} model needs "
                                  + ", ".join(problems) + f"; the checkpoint's flags are {dict(args)}")
    base = _shared_config(args, vocab_size, dtype)
    if moe:
        return hf_moe.hf_config(args, base)
    qwen2 = bool(args.get("add_qkv_bias"))
    out = {"architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
           "model_type": "qwen2" if qwen2 else "llama", **base, "intermediate_size": args["ffn_hidden_size"],
           "attention_bias": False, "mlp_bias": False}
    if qwen2:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=args["num_layers"])
    return out


def _shared_config(args: Mapping, vocab_size: int, dtype: torch.dtype) -> dict:
    """The config.json fields every architecture here has, from pretraining flags `args`."""
    heads, hidden = args["num_attention_heads"], args["hidden_size"]
    groups = args["num_query_groups"] if args.get("group_query_attention") else heads
    out = {
        "hidden_size": hidden, "num_hidden_layers": args["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": groups, "head_dim": args.get("kv_channels") or hidden // heads, "hidden_act": "silu",
        "rms_norm_eps": args.get("norm_epsilon", 1e-5), "vocab_size": vocab_size,
        "max_position_embeddings": args["max_position_embeddings"], "rope_theta": float(args.get("rotary_base", 10000)),
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if args.get("use_rope_scaling"):
        out["rope_scaling"] = {"rope_type": "llama3", "factor": float(args.get("rope_scaling_factor", 8.0)),
                               **_LLAMA3_FIXED}
    return out
