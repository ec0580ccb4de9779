"""Which module classes are FSDP units unless the caller says otherwise.

Megatron-Core's wrapper names its default units (TransformerLayer,
LanguageModelEmbedding, RotaryEmbedding, ColumnParallelLinear) in its
constructor's signature, which makes the data-parallel package import the
models. Here each class declares itself instead, where it is defined:

    @default_fsdp_unit
    class TransformerLayer(nn.Module): ...

A class cannot have instances before its module is imported, so every class
a model can hold has declared itself by the time the model is wrapped.
DEFAULT_SUB_MODULES_TO_WRAP is a live, read-only set of the declared classes.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Iterator

from torch import nn

_declared: list[type] = []


def default_fsdp_unit(cls: type) -> type:
    """Declare `cls` a default FSDP unit (usable as a class decorator):
    TorchFullyShardedDataParallel shards every instance of it on its own
    when no `sub_modules_to_wrap` is given."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"a default FSDP unit must be an nn.Module subclass, got {cls!r}")
    if cls not in _declared:
        _declared.append(cls)
    return cls


class _DeclaredUnits(Set):
    """The classes declared with default_fsdp_unit, as they are now."""

    def __contains__(self, cls) -> bool:
        return cls in _declared

    def __iter__(self) -> Iterator[type]:
        return iter(list(_declared))

    def __len__(self) -> int:
        return len(_declared)

    def __repr__(self) -> str:
        return "{" + ", ".join(c.__name__ for c in _declared) + "}"


DEFAULT_SUB_MODULES_TO_WRAP: Set = _DeclaredUnits()
