"""ModuleSpec, at Megatron-Core's path, for code written against its spec API.

megatron_fsdp has one layer implementation: a spec names the layer class
(TransformerLayer or a subclass of it) and nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .transformer_layer import TransformerLayer


@dataclasses.dataclass
class ModuleSpec:
    module: type
    params: dict = dataclasses.field(default_factory=dict)
    submodules: Optional[object] = None


def layer_class_from_spec(spec, where: str = "transformer_layer_spec") -> type:
    """The TransformerLayer class a spec names (None: TransformerLayer itself)."""
    if spec is None:
        return TransformerLayer
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if isinstance(module, type) and issubclass(module, TransformerLayer):
        if isinstance(spec, ModuleSpec) and (spec.params or spec.submodules is not None):
            raise NotImplementedError(
                f"{where}: ModuleSpec params and submodules are not supported (got params={spec.params!r}, "
                f"submodules={spec.submodules!r}); megatron_fsdp's layer builds its own submodules")
        return module
    raise TypeError(
        f"{where} must be None, a TransformerLayer subclass or a ModuleSpec of one, got {spec!r}")
