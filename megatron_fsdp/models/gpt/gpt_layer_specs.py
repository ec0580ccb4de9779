"""Layer specs, for code written against Megatron-Core's spec API.

megatron_fsdp has one layer implementation; a spec names the layer class
and pins what Megatron's getters decide through submodules: query/key
normalization, and the norm type when `normalization` is given. Both getters
return the same spec: we have no Transformer Engine layers.
"""

from __future__ import annotations

from typing import Optional

from ...transformer.spec_utils import ModuleSpec, layer_class_from_spec
from ...transformer.transformer_layer import TransformerLayer
from ...utils import reject_unsupported

__all__ = ["ModuleSpec", "get_gpt_decoder_block_spec", "get_gpt_layer_local_spec",
           "get_gpt_layer_with_transformer_engine_spec", "layer_class_from_spec"]


def _layer_spec(where: str, *, num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention,
                normalization=None, **options) -> ModuleSpec:
    # `fp8` is accepted and unused, as in Megatron-Core (fp8 is a config choice).
    options.pop("fp8", None)
    known_off = {"qk_l2_norm": False, "use_kitchen": False, "use_kitchen_attention": False,
                 "use_te_op_fuser": False, "use_te_activation_func": False, "mla_down_proj_fusion": False,
                 "use_grouped_gemm_for_dense_mlp": False}
    unknown = sorted(set(options) - set(known_off) - {"kitchen_attention_backend"})
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword arguments {unknown}")
    checks = {"multi_latent_attention": (multi_latent_attention, False, "multi-latent attention is not supported")}
    checks.update({name: (options[name], False) for name in known_off if name in options})
    reject_unsupported(where, checks)
    params = {"qk_layernorm": bool(qk_layernorm)}
    if normalization is not None:
        params["normalization"] = normalization
    if num_experts is not None:
        # NOTE: the layer takes its MoE settings from the config; the spec pins the expert count and
        # the GEMM choice, as Megatron's MoE submodules do. Which layers are MoE: moe_layer_freq.
        params.update(num_moe_experts=num_experts, moe_grouped_gemm=bool(moe_grouped_gemm))
    elif moe_grouped_gemm:
        raise ValueError(f"{where}: moe_grouped_gemm=True needs num_experts")
    spec = ModuleSpec(module=TransformerLayer, params=params)
    layer_class_from_spec(spec, where)  # a bad normalization fails here
    return spec


def get_gpt_layer_local_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                             qk_layernorm: bool = False, multi_latent_attention: bool = False,
                             fp8: Optional[str] = None, normalization: Optional[str] = None,
                             **options) -> ModuleSpec:
    """Megatron-Core's local spec: layers with query/key norm iff `qk_layernorm`
    (overriding TransformerConfig.qk_layernorm), and `normalization` overriding
    the config's norm type when given."""
    return _layer_spec("get_gpt_layer_local_spec", num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                       qk_layernorm=qk_layernorm, multi_latent_attention=multi_latent_attention,
                       normalization=normalization, fp8=fp8, **options)


def get_gpt_layer_with_transformer_engine_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                                               qk_layernorm: bool = False, multi_latent_attention: bool = False,
                                               fp8: Optional[str] = None, **options) -> ModuleSpec:
    """The same layer as the local spec: megatron_fsdp does not use Transformer Engine layers."""
    return _layer_spec("get_gpt_layer_with_transformer_engine_spec", num_experts=num_experts,
                       moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm,
                       multi_latent_attention=multi_latent_attention, fp8=fp8, **options)


def get_gpt_decoder_block_spec(config, use_transformer_engine: bool = True, normalization: Optional[str] = None,
                               qk_l2_norm: Optional[bool] = False, vp_stage: Optional[int] = None,
                               pp_rank: Optional[int] = None) -> ModuleSpec:
    """Megatron-Core's decoder-block spec for dense and MoE layers. Megatron returns one spec per
    layer (dense or MoE by config.moe_layer_freq); our one layer class reads moe_layer_freq itself,
    so this is one spec for every layer, pinning the config's expert count and GEMM choice."""
    reject_unsupported("get_gpt_decoder_block_spec", {
        "qk_l2_norm": (bool(qk_l2_norm), False), "vp_stage": (vp_stage, None, "there is no pipeline parallelism"),
        "pp_rank": (pp_rank, None, "there is no pipeline parallelism")})
    getter = get_gpt_layer_with_transformer_engine_spec if use_transformer_engine else get_gpt_layer_local_spec
    extra = {} if use_transformer_engine or normalization is None else {"normalization": normalization}
    return getter(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                  qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention, **extra)
