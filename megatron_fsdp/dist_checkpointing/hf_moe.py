"""Hugging Face mixture-of-experts models <-> megatron_fsdp's GPT with MoE layers (full tensors,
TP=1 names): what hf.py hands over for Mixtral, Qwen2-MoE and Qwen3-MoE. hf.py keeps what every
architecture shares (embeddings, attention, norms, a dense layer's MLP); this module maps a sparse
layer's MLP, the MoE fields of the config, and picks the architecture on export. The names are
those `transformers` saves and published checkpoints hold: one tensor per expert (its in-memory
model fuses a layer's experts into `experts.gate_up_proj` and `experts.down_proj`, which
save_pretrained writes back per expert).

  Mixtral    model.layers.i.block_sparse_moe.gate.weight [E, H]      decoder.layers.i.mlp.router.weight
             ...block_sparse_moe.experts.{e}.w1, w3 [F, H]           mlp.experts.linear_fc1.weight [E, 2, F, H]
                                                                     (index 0 = w1, the gate; 1 = w3, up)
             ...block_sparse_moe.experts.{e}.w2 [H, F]               mlp.experts.linear_fc2.weight [E, H, F]
  Qwen2/3-MoE model.layers.i.mlp.gate.weight, mlp.experts.{e}.{gate,up,down}_proj.weight: the same
  Qwen2-MoE  ...mlp.shared_expert.{gate,up}_proj [S, H]              mlp.shared_experts.linear_fc1 [gate; up]
             ...mlp.shared_expert.down_proj [H, S]                   mlp.shared_experts.linear_fc2.weight
             ...mlp.shared_expert_gate.weight [1, H]                 mlp.shared_experts.gate_weight

Routing (transformers' modeling code): every model takes a softmax over all experts in fp32 and
its top k. Mixtral, and Qwen with `norm_topk_prob`, renormalize the k weights to sum 1: that is a
softmax over the k chosen logits, our `moe_router_pre_softmax=False`. Qwen without it keeps the
weights as they are: our `moe_router_pre_softmax=True`. Qwen's layer i (from 0) is sparse iff
i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; Megatron's integer
`moe_layer_freq` N means i % N == 0, so any other pattern is written as the explicit 0/1 list.
Dense layers use `intermediate_size` (our ffn_hidden_size), experts `moe_intermediate_size`
(moe_ffn_hidden_size); Mixtral's experts use `intermediate_size`. `router_aux_loss_coef` is
`moe_aux_loss_coeff` (transformers adds that loss in training only with `output_router_logits`, an
option of the forward pass: see docs/checkpoints.md for how the two losses differ).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
MIXTRAL, QWEN2_MOE, QWEN3_MOE = ARCHITECTURES
Recipe = dict[str, tuple[tuple[str, ...], Callable[..., torch.Tensor]]]


def is_moe(hf: Mapping) -> bool:
    return any(a in ARCHITECTURES for a in hf.get("architectures") or [])


def _arch(hf: Mapping) -> str:
    return hf["architectures"][0]


def num_experts(hf: Mapping) -> int:
    # Qwen3-MoE's config maps num_experts to num_local_experts when saved by transformers 5;
    # published config.json files say num_experts.
    if _arch(hf) == MIXTRAL:
        return hf["num_local_experts"]
    return hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]


def sparse_layers(hf: Mapping) -> list[int]:
    """1 for each layer with experts, 0 for a dense one (transformers' rule, see above)."""
    layers = hf["num_hidden_layers"]
    if _arch(hf) == MIXTRAL:
        return [1] * layers
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def _renormalized(hf: Mapping) -> bool:
    return _arch(hf) == MIXTRAL or bool(hf.get("norm_topk_prob", False))


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_config(hf: Mapping) -> None:
    """Raise for what a MoE config.json holds that our MoE layer cannot represent, naming it."""
    arch, experts, topk = _arch(hf), num_experts(hf), hf.get("num_experts_per_tok")
    if len(hf["architectures"]) != 1:
        raise ValueError(f"architectures {hf['architectures']}: a mixture-of-experts model names one")
    if not _is_int(experts, 1):
        raise NotImplementedError(f"num_experts={experts!r}: a model without experts is not a {arch}")
    if not _is_int(topk, 1) or topk > experts:
        raise ValueError(f"num_experts_per_tok={topk!r}: must be between 1 and the {experts} experts")
    if topk == 1 and _renormalized(hf):
        # One renormalized weight is always 1; our top-1 routing weighs by the probability
        # (Megatron allows only pre-softmax routing at top-1).
        raise NotImplementedError("num_experts_per_tok=1 with renormalized top-k weights (Mixtral, or "
                                  "norm_topk_prob=True) is not supported")
    if arch == MIXTRAL and hf.get("router_jitter_noise", 0.0):
        raise NotImplementedError(f"router_jitter_noise={hf['router_jitter_noise']}: the router's input jitter "
                                  "is not supported")
    if arch != MIXTRAL:
        _check_qwen(hf)


def _check_qwen(hf: Mapping) -> None:
    layers, step, dense = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not _is_int(step, 1):
        raise ValueError(f"decoder_sparse_step={step!r}: must be a positive integer")
    if not isinstance(dense, list) or not all(_is_int(i, 0) and i < layers for i in dense):
        raise ValueError(f"mlp_only_layers={dense!r}: must list layer indices below {layers}")
    if _arch(hf) == QWEN2_MOE and not _is_int(hf.get("shared_expert_intermediate_size"), 1):
        raise NotImplementedError(f"shared_expert_intermediate_size={hf.get('shared_expert_intermediate_size')!r}: "
                                  "a Qwen2-MoE without a shared expert is not supported")


def _layer_freq(pattern: list[int]):
    return 1 if all(pattern) else pattern


def config_fields(hf: Mapping) -> dict:
    """The TransformerConfig MoE fields of a MoE config.json."""
    arch = _arch(hf)
    fields = dict(num_moe_experts=num_experts(hf), moe_router_topk=hf["num_experts_per_tok"],
                  moe_ffn_hidden_size=hf["intermediate_size"] if arch == MIXTRAL else hf["moe_intermediate_size"],
                  moe_layer_freq=_layer_freq(sparse_layers(hf)), moe_router_pre_softmax=not _renormalized(hf),
                  moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    if arch == QWEN2_MOE:
        fields.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                      moe_shared_expert_gate=True)
    return fields


def model_args(hf: Mapping) -> dict:
    """The MoE pretraining flags (destination names) of a MoE config.json."""
    fields = config_fields(hf)
    return {"num_experts": fields.pop("num_moe_experts"), "moe_router_score_function": "softmax",
            "moe_router_enable_expert_bias": False, **fields}


# ---------------------------------------------------------------------- tensors


def _names(hf: Mapping, i: int) -> tuple[str, tuple[str, str, str]]:
    """(the sparse block's prefix, its experts' gate/up/down names)."""
    if _arch(hf) == MIXTRAL:
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
    return f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")


def _stack_fc1(*tensors: torch.Tensor) -> torch.Tensor:
    """gate_0, up_0, gate_1, up_1, ... -> [E, 2, F, H]."""
    return torch.stack(tensors).reshape(len(tensors) // 2, 2, *tensors[0].shape)


def _stack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.stack(tensors)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def layer_to_ours(hf: Mapping, i: int) -> Recipe:
    """How layer i's sparse MLP (ours) is made from HF's tensors."""
    src, (gate, up, down) = _names(hf, i)
    dst, experts = f"decoder.layers.{i}.mlp.", range(num_experts(hf))
    out: Recipe = {
        dst + "router.weight": ((src + "gate.weight",), _same),
        dst + "experts.linear_fc1.weight": (
            tuple(f"{src}experts.{e}.{n}.weight" for e in experts for n in (gate, up)), _stack_fc1),
        dst + "experts.linear_fc2.weight": (tuple(f"{src}experts.{e}.{down}.weight" for e in experts), _stack),
    }
    if _arch(hf) == QWEN2_MOE:
        shared = src + "shared_expert."
        out[dst + "shared_experts.linear_fc1.weight"] = (
            (shared + "gate_proj.weight", shared + "up_proj.weight"), lambda g, u: torch.cat((g, u)))
        out[dst + "shared_experts.linear_fc2.weight"] = ((shared + "down_proj.weight",), _same)
        out[dst + "shared_experts.gate_weight"] = ((src + "shared_expert_gate.weight",), _same)
    return out


def _expert(e: int, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Expert e's part k of fc1 [E, 2, F, H] (k = 0 the gate, 1 up), or of fc2 [E, H, F] (k = None)."""
    return (lambda t: t[e].contiguous()) if k is None else (lambda t: t[e, k].contiguous())


def layer_to_hf(hf: Mapping, i: int) -> Recipe:
    """How HF's tensors of layer i's sparse MLP are made from ours."""
    dst, (gate, up, down) = _names(hf, i)
    src = f"decoder.layers.{i}.mlp."
    fc1, fc2 = (src + "experts.linear_fc1.weight",), (src + "experts.linear_fc2.weight",)
    out: Recipe = {dst + "gate.weight": ((src + "router.weight",), _same)}
    for e in range(num_experts(hf)):
        out[f"{dst}experts.{e}.{gate}.weight"] = (fc1, _expert(e, 0))
        out[f"{dst}experts.{e}.{up}.weight"] = (fc1, _expert(e, 1))
        out[f"{dst}experts.{e}.{down}.weight"] = (fc2, _expert(e, None))
    if _arch(hf) == QWEN2_MOE:
        shared = (src + "shared_experts.linear_fc1.weight",)
        out[dst + "shared_expert.gate_proj.weight"] = (shared, lambda t: t.chunk(2)[0].contiguous())
        out[dst + "shared_expert.up_proj.weight"] = (shared, lambda t: t.chunk(2)[1].contiguous())
        out[dst + "shared_expert.down_proj.weight"] = ((src + "shared_experts.linear_fc2.weight",), _same)
        out[dst + "shared_expert_gate.weight"] = ((src + "shared_experts.gate_weight",), _same)
    return out


def expected_shapes(hf: Mapping, i: int) -> dict[str, tuple[int, ...]]:
    """HF's tensors of layer i's sparse MLP and the shapes config.json gives them."""
    src, (gate, up, down) = _names(hf, i)
    hidden, ffn = hf["hidden_size"], config_fields(hf)["moe_ffn_hidden_size"]
    out = {src + "gate.weight": (num_experts(hf), hidden)}
    for e in range(num_experts(hf)):
        out.update({f"{src}experts.{e}.{gate}.weight": (ffn, hidden), f"{src}experts.{e}.{up}.weight": (ffn, hidden),
                    f"{src}experts.{e}.{down}.weight": (hidden, ffn)})
    if _arch(hf) == QWEN2_MOE:
        shared = hf["shared_expert_intermediate_size"]
        out.update({src + "shared_expert.gate_proj.weight": (shared, hidden),
                    src + "shared_expert.up_proj.weight": (shared, hidden),
                    src + "shared_expert.down_proj.weight": (hidden, shared),
                    src + "shared_expert_gate.weight": (1, hidden)})
    return out


# ---------------------------------------------------------------------- export


def _pattern(args: Mapping) -> list[int]:
    """Our moe_layer_freq as a 0/1 list (Megatron's int N: layer i has experts iff i % N == 0)."""
    freq, layers = args.get("moe_layer_freq", 1), args["num_layers"]
    return list(freq) if isinstance(freq, (list, tuple)) else [int(i % freq == 0) for i in range(layers)]


def export_architecture(args: Mapping) -> str:
    """The HF architecture that holds the MoE model of pretraining flags `args`: query/key norms ->
    Qwen3-MoE; a shared expert or q/k/v biases -> Qwen2-MoE; else Mixtral. Raises, in one line,
    for what that architecture cannot hold."""
    problems = [what for what, bad in (
        (f"--moe-router-score-function {args.get('moe_router_score_function')} (softmax only)",
         args.get("moe_router_score_function", "softmax") != "softmax"),
        ("--moe-router-enable-expert-bias (no expert bias)", args.get("moe_router_enable_expert_bias")),
        (f"--moe-router-topk-scaling-factor {args.get('moe_router_topk_scaling_factor')} (none)",
         args.get("moe_router_topk_scaling_factor") is not None)) if bad]
    shared, gate = args.get("moe_shared_expert_intermediate_size"), args.get("moe_shared_expert_gate")
    if args.get("qk_layernorm"):
        arch = QWEN3_MOE
        problems += [what for what, bad in (("no shared expert", shared), ("no q/k/v biases", args.get("add_qkv_bias")))
                     if bad]
    elif shared or args.get("add_qkv_bias"):
        arch = QWEN2_MOE
        if not (shared and gate):
            problems.append("a shared expert with its gate (--moe-shared-expert-intermediate-size and "
                            "--moe-shared-expert-gate)")
    else:
        arch = MIXTRAL
        problems += [what for what, bad in (
            ("top-k then softmax routing (not --moe-router-pre-softmax)", args.get("moe_router_pre_softmax")),
            (f"experts in every layer (--moe-layer-freq {args.get('moe_layer_freq')})", not all(_pattern(args))))
            if bad]
    if problems:
        raise NotImplementedError(f"a Hugging Face {arch} needs " + "; ".join(problems)
                                  + " (picked from the flags: --qk-layernorm -> Qwen3-MoE; a shared expert or "
                                    "--add-qkv-bias -> Qwen2-MoE; else Mixtral)")
    return arch


def hf_config(args: Mapping, base: dict) -> dict:
    """config.json of the MoE model of pretraining flags `args`: `base` (the fields every
    architecture shares, hf.py's) with the architecture's own."""
    arch = export_architecture(args)
    experts, topk, layers = args["num_experts"], args["moe_router_topk"], args["num_layers"]
    moe_ffn = args.get("moe_ffn_hidden_size") or args["ffn_hidden_size"]
    pattern = _pattern(args)
    out = {"architectures": [arch], **base, "num_experts_per_tok": topk,
           "router_aux_loss_coef": float(args.get("moe_aux_loss_coeff") or 0.0), "output_router_logits": False}
    if arch == MIXTRAL:
        out.update(model_type="mixtral", intermediate_size=moe_ffn, num_local_experts=experts, router_jitter_noise=0.0,
                   sliding_window=None)
        return out
    out.update(model_type="qwen3_moe" if arch == QWEN3_MOE else "qwen2_moe", num_experts=experts,
               intermediate_size=args["ffn_hidden_size"], moe_intermediate_size=moe_ffn,
               norm_topk_prob=not args.get("moe_router_pre_softmax"), decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(layers) if not pattern[i]], use_sliding_window=False,
               sliding_window=None, max_window_layers=layers)
    if arch == QWEN2_MOE:
        out.update(shared_expert_intermediate_size=args["moe_shared_expert_intermediate_size"],
                   qkv_bias=bool(args.get("add_qkv_bias")))
    else:
        out.update(attention_bias=False)
    return out
