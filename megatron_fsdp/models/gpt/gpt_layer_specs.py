"""Layer specs, for code written against Megatron-Core's spec API.

megatron_fsdp has one layer implementation; a spec only names the layer class
(TransformerLayer or a subclass of it). Both getters return that spec.
"""

from __future__ import annotations

from ...transformer.spec_utils import ModuleSpec, layer_class_from_spec
from ...transformer.transformer_layer import TransformerLayer

__all__ = ["ModuleSpec", "get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec",
           "layer_class_from_spec"]


def _layer_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                multi_latent_attention=False, **unused_kwargs) -> ModuleSpec:
    if num_experts is not None or moe_grouped_gemm:
        raise NotImplementedError("mixture-of-experts layer specs are not supported")
    if multi_latent_attention:
        raise NotImplementedError("multi-latent attention layer specs are not supported")
    # qk_layernorm is read from TransformerConfig.qk_layernorm, as in Megatron's layer.
    return ModuleSpec(module=TransformerLayer)


def get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                             multi_latent_attention=False, **kwargs) -> ModuleSpec:
    return _layer_spec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, **kwargs)


def get_gpt_layer_with_transformer_engine_spec(num_experts=None, moe_grouped_gemm=False,
                                               qk_layernorm=False, multi_latent_attention=False,
                                               **kwargs) -> ModuleSpec:
    """Same layer as the local spec: megatron_fsdp does not use Transformer Engine layers."""
    return _layer_spec(num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, **kwargs)
