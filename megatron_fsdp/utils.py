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
