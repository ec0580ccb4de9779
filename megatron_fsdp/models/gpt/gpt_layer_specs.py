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

__all__ = ["ModuleSpec", "get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec",
           "layer_class_from_spec"]


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
    checks = {
        "num_experts": (num_experts, None, "mixture-of-experts layers are not supported"),
        "moe_grouped_gemm": (moe_grouped_gemm, False, "mixture-of-experts layers are not supported"),
        "multi_latent_attention": (multi_latent_attention, False, "multi-latent attention is not supported"),
    }
    checks.update({name: (options[name], False) for name in known_off if name in options})
    reject_unsupported(where, checks)
    params = {"qk_layernorm": bool(qk_layernorm)}
    if normalization is not None:
        params["normalization"] = normalization
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
