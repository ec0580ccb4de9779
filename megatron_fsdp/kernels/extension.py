"""Loading the C++/CUDA extension (megatron_fsdp._C), checked first.

Before the extension is imported, a child process checks that an error raised
inside it arrives in Python as an exception (build_check.py: a build against
another C++ runtime than the one loaded here dies instead). The verdict is
cached per built .so; a broken build counts as not available, with the reason
(compiler, both C++ runtimes, the cure) as its import error. Every kernel
module imports these from here (not from the package's __init__, which
re-exports them), so that no module of the package imports its own package.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import warnings

from .. import _torch_compat
from . import build_check


class ExtensionRuntimeError(ImportError):
    """The extension imports but an error raised inside it kills the process (a C++ runtime mismatch)."""


@functools.lru_cache(maxsize=None)
def _load_extension():
    name = f"{__name__.rsplit('.', 2)[0]}._C"
    verdict = None
    if name not in sys.modules:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            spec = None
        if spec is not None and spec.origin and spec.has_location:
            verdict = build_check.check_extension(spec.origin)
            if not verdict.ok:
                warnings.warn(f"megatron_fsdp's C++/CUDA extension is not used (pure-PyTorch fallbacks run): "
                              f"{verdict.message}", RuntimeWarning, stacklevel=2)
                return ExtensionRuntimeError(verdict.message, name=name, path=spec.origin)
    try:
        from .. import _C  # noqa: F401  (registers torch.ops.megatron_fsdp)
    except ImportError as exc:
        return exc
    if verdict is not None and verdict.status in ("failed", "timeout", "killed"):
        # The check could not tell (the import here worked): say so once, use the extension as before.
        warnings.warn(f"megatron_fsdp: {verdict.message}", RuntimeWarning, stacklevel=2)
    return _C


def extension_available() -> bool:
    return not isinstance(_load_extension(), ImportError)


def extension_has_cuda() -> bool:
    ext = _load_extension()
    return not isinstance(ext, ImportError) and bool(ext.has_cuda)


@_torch_compat.assume_constant_result
def extension_serves(device_type: str) -> bool:
    """Whether the extension has kernels for tensors on `device_type` ("cpu" or "cuda"). Fixed for
    the process, and a compiled graph takes it as a constant instead of tracing the loader."""
    if device_type == "cpu":
        return extension_available()
    return device_type == "cuda" and extension_has_cuda()


def extension_import_error() -> ImportError | None:
    ext = _load_extension()
    return ext if isinstance(ext, ImportError) else None


