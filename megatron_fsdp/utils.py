"""Small helpers shared across the package (Megatron-Core's `megatron.core.utils` place)."""

from __future__ import annotations

from typing import Any, Mapping


def reject_unsupported(where: str, options: Mapping[str, tuple], *,
                       error: type[Exception] = NotImplementedError) -> None:
    """The one place that turns "Megatron has this option, we do not" into an error.

    `options` maps a name to `(value, allowed)` or `(value, allowed, why)`:
    a value other than `allowed` raises `error` naming the option, the value,
    what is allowed and why. `allowed=None` means "must be None" and is
    checked by identity, so tensors (forward arguments) can be passed.
    Callers check everything before any work or communication starts.
    """
    for name, spec in options.items():
        value, allowed, *why = spec
        unsupported = value is not None if allowed is None else _differs(value, allowed)
        if unsupported:
            # A tensor or module argument is named by its type (its repr can be huge);
            # a plain value is shown as itself, as the docstring promises.
            shown = repr(value) if allowed is not None or isinstance(value, (bool, int, float, str)) \
                else type(value).__name__
            reason = f": {why[0]}" if why else ""
            raise error(f"{where}: {name}={shown} is not supported by megatron_fsdp "
                        f"(only {allowed!r}){reason}")


def _differs(value: Any, allowed: Any) -> bool:
    try:
        return bool(value != allowed)
    except Exception:  # an object whose != is not a plain bool (a tensor, say)
        return True


def unwrap_model(model, module_instances=None):
    """Megatron-Core's helper: the model(s) inside their wrappers (a list
    stays a list). `module_instances`: the wrapper classes to look through;
    by default the data-parallel wrappers, which say so with the class
    attribute `is_data_parallel_wrapper` (they live above this module)."""
    def is_wrapper(m):
        if module_instances is not None:
            return isinstance(m, module_instances)
        return getattr(type(m), "is_data_parallel_wrapper", False)

    chunks = model if isinstance(model, list) else [model]
    unwrapped = []
    for chunk in chunks:
        while is_wrapper(chunk):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped if isinstance(model, list) else unwrapped[0]


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """`attr` of `model`, looked up through wrappers (`.module` chains: the
    data-parallel wrapper, Float16Module-style wrappers) as Megatron-Core does.

    With `allow_none=False` an attribute whose value is None does not count
    as found. `return_model_obj=True` returns the (sub)module that holds it.
    """
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model was given a list of model chunks; pass one chunk")
    found = (lambda m: hasattr(m, attr)) if allow_none else (lambda m: getattr(m, attr, None) is not None)
    holder = model
    while not found(holder):
        if not hasattr(holder, "module"):
            raise RuntimeError(f"get_attr_wrapped_model: {type(model).__name__} and the modules it wraps "
                               f"have no attribute {attr!r}")
        holder = holder.module
    return holder if return_model_obj else getattr(holder, attr)


def get_model_config(model):
    """The TransformerConfig (`.config`) of a model chunk, wrapped or not (Megatron-Core's helper)."""
    return get_attr_wrapped_model(model, "config", allow_none=False)
