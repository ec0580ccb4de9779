"""Python face of the C++/CUDA extension (csrc/).

Importing `megatron_fsdp._C` registers the `torch.ops.megatron_fsdp.*` ops.
When the extension was not built, the same functions run a pure-PyTorch
fallback with identical results, and `extension_available()` says so.

  pack_into          many tensors into one flat buffer (FSDP copy-in; fsdp_copy_ops installs
                     the kernels behind FSDP2's own copy ops)
  multi_tensor_amax  max(|t|) of many tensors in one pass (fp8 scales)
  cast_to_fp8        scaled, saturating cast into fp8 bytes (fp8 all-gather inputs)
  crc32c             CRC-32C of a buffer (checkpoint checksums)

Before the extension is imported, a child process checks that an error raised
inside it arrives in Python as an exception (build_check.py: a build against
another C++ runtime than the one loaded here dies instead). The verdict is
cached per built .so; a broken build counts as not available, with the reason
(compiler, both C++ runtimes, the cure) as its import error.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import warnings
from typing import Sequence

import torch

from . import build_check


class ExtensionRuntimeError(ImportError):
    """The extension imports but an error raised inside it kills the process (a C++ runtime mismatch)."""


@functools.lru_cache(maxsize=None)
def _load_extension():
    name = f"{__name__.rsplit('.', 1)[0]}._C"
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


def extension_import_error() -> ImportError | None:
    ext = _load_extension()
    return ext if isinstance(ext, ImportError) else None


def _pack_into_reference(inputs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    total = sum(t.numel() for t in inputs)
    if out.dim() != 1:
        raise RuntimeError(f"pack_into: out must be 1-D, got {out.dim()} dimensions")
    if not out.is_contiguous():
        raise RuntimeError("pack_into: out must be contiguous")
    for i, t in enumerate(inputs):
        if t.device != out.device:
            raise RuntimeError(f"pack_into: inputs[{i}] is on {t.device} but out is on {out.device}")
    if total > out.numel():
        raise RuntimeError(f"pack_into: inputs hold {total} elements but out has only {out.numel()}")
    offset = 0
    for t in inputs:
        out[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()


def pack_into(inputs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Copy `inputs`, each flattened, back to back into the 1-D buffer `out`
    (casting to out's dtype). Raises before writing anything if `out` is too
    small or on another device."""
    ext = _load_extension()
    if (out.device.type == "cpu" and extension_available()) or (out.device.type == "cuda" and extension_has_cuda()):
        ext.pack_into(list(inputs), out)  # direct call: no per-tensor boxing
    else:
        _pack_into_reference(inputs, out)


# The other kernels' Python faces (each with its pure-PyTorch fallback).
from .amax import multi_tensor_amax  # noqa: E402
from .crc import crc32c  # noqa: E402
from .fp8_cast import cast_to_fp8  # noqa: E402
