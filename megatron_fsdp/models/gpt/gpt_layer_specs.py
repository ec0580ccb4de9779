"""Layer specs, for code written against Megatron-Core's spec API.

megatron_fsdp has one layer implementation; a spec only names the layer class
(TransformerLayer or a subclass of it). Both getters return that spec.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ...transformer.transformer_layer import TransformerLayer


@dataclasses.dataclass
class ModuleSpec:
    module: type
    params: dict = dataclasses.field(default_factory=dict)
    submodules: Optional[object] = None


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


def layer_class_from_spec(spec) -> type:
    if spec is None:
        return TransformerLayer
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if isinstance(module, type) and issubclass(module, TransformerLayer):
        if isinstance(spec, ModuleSpec) and (spec.params or spec.submodules is not None):
            raise NotImplementedError("ModuleSpec params and submodules are not supported")
        return module
    raise TypeError(
        f"transformer_layer_spec must be None, a TransformerLayer subclass or a ModuleSpec of one, "
        f"got {spec!r}"
    )
