"""ModuleSpec, at Megatron-Core's path, for code written against its spec API.

megatron_fsdp has one layer implementation: a spec names the layer class
(TransformerLayer or a subclass of it) and, through `params`, the few layer
choices Megatron's spec getters make (`qk_layernorm`, `normalization`, and with
`num_experts` the mixture of experts: `num_moe_experts`, `moe_grouped_gemm`).
Those override the TransformerConfig for the layers built from the spec, as the
spec's submodules do in Megatron-Core.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from .transformer_layer import TransformerLayer

# The config fields a spec may pin, and the values each accepts (a tuple, or a test and its words).
SPEC_PARAMS = {"qk_layernorm": (True, False), "normalization": ("LayerNorm", "RMSNorm"),
               "num_moe_experts": (lambda n: isinstance(n, int) and not isinstance(n, bool) and n > 0,
                                   "a positive int"),
               "moe_grouped_gemm": (True, False)}


def _accepts(name: str, value) -> bool:
    allowed = SPEC_PARAMS[name]
    return allowed[0](value) if callable(allowed[0]) else value in allowed


@dataclasses.dataclass
class ModuleSpec:
    module: type
    params: dict = dataclasses.field(default_factory=dict)
    submodules: Optional[object] = None


@functools.lru_cache(maxsize=None)
def _layer_with_pinned_config(layer_cls: type, pinned: tuple) -> type:
    """A subclass of `layer_cls` building itself with config fields `pinned`."""

    def __init__(self, config, *args, **kwargs):
        layer_cls.__init__(self, dataclasses.replace(config, **dict(pinned)), *args, **kwargs)

    # Same class name: checkpoints and reprs do not change with a spec.
    return type(layer_cls.__name__, (layer_cls,), {"__init__": __init__, "__module__": layer_cls.__module__,
                                                  "__qualname__": layer_cls.__qualname__})


def layer_class_from_spec(spec, where: str = "transformer_layer_spec") -> type:
    """The TransformerLayer class a spec names (None: TransformerLayer itself)."""
    if spec is None:
        return TransformerLayer
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if not (isinstance(module, type) and issubclass(module, TransformerLayer)):
        raise TypeError(
            f"{where} must be None, a TransformerLayer subclass or a ModuleSpec of one, got {spec!r}")
    if not isinstance(spec, ModuleSpec):
        return module
    if spec.submodules is not None:
        raise NotImplementedError(
            f"{where}: ModuleSpec submodules are not supported (got {spec.submodules!r}); "
            "megatron_fsdp's layer builds its own submodules")
    for name, value in spec.params.items():
        if name not in SPEC_PARAMS:
            raise NotImplementedError(
                f"{where}: ModuleSpec param {name!r} is not supported; supported: {sorted(SPEC_PARAMS)}")
        if not _accepts(name, value):
            allowed = SPEC_PARAMS[name][1] if callable(SPEC_PARAMS[name][0]) else SPEC_PARAMS[name]
            raise ValueError(f"{where}: ModuleSpec param {name}={value!r}; allowed: {allowed}")
    if not spec.params:
        return module
    return _layer_with_pinned_config(module, tuple(sorted(spec.params.items())))
