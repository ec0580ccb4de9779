"""Python face of the C++/CUDA extension (csrc/).

Importing `megatron_fsdp._C` registers the `torch.ops.megatron_fsdp.*` ops.
When the extension was not built, the same functions run a pure-PyTorch
fallback with identical results, and `extension_available()` says so.

  pack_into          many tensors into one flat buffer (FSDP copy-in; fsdp_copy_ops installs
                     the kernels behind FSDP2's own copy ops)
  multi_tensor_amax  max(|t|) of many tensors in one pass (fp8 scales)
  cast_to_fp8        scaled, saturating cast into fp8 bytes (fp8 all-gather inputs)
  crc32c             CRC-32C of a buffer (checkpoint checksums)

extension.py loads it, after checking in a child process that an error raised
inside it arrives in Python as an exception (build_check.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .extension import (  # noqa: F401  (the package's face)
    ExtensionRuntimeError,
    _load_extension,
    extension_available,
    extension_has_cuda,
    extension_import_error,
    extension_serves,
)
from .amax import multi_tensor_amax  # noqa: F401  (the other kernels' faces, each with its fallback)
from .crc import crc32c  # noqa: F401
from .fp8_cast import cast_to_fp8, cast_transpose_to_fp8  # noqa: F401


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
    if extension_serves(out.device.type):
        ext.pack_into(list(inputs), out)  # direct call: no per-tensor boxing
    else:
        _pack_into_reference(inputs, out)


