"""Fused absolute maximum of many tensors (fp8 weight scales).

`multi_tensor_amax(tensors)` returns a float32 1-D tensor holding max(|t|)
of each input (0 for an empty tensor; NaN if a tensor holds a NaN), computed
in one pass over all inputs: on CPU one parallel region for all tensors
(csrc/fp8_kernels.cpp), on CUDA one kernel launch (csrc/fp8_kernels_cuda.cu).
Where no kernel serves the inputs' device (extension not built, or built
without CUDA), a pure-PyTorch fallback gives identical results: the max of
absolute values is exact, whatever the order of evaluation.

The op is also registered as `torch.ops.megatron_fsdp.multi_tensor_amax`
(CPU, CUDA, Meta); this function calls the kernel directly, which skips the
dispatcher's per-tensor boxing (it matters for hundreds of small weights)
and records no autograd history.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .extension import _load_extension, extension_serves

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check(tensors: Sequence[torch.Tensor]) -> None:
    for i, t in enumerate(tensors):
        if t.device != tensors[0].device:
            raise RuntimeError(f"multi_tensor_amax: tensors[{i}] is on {t.device} but tensors[0] is on "
                               f"{tensors[0].device}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise RuntimeError(f"multi_tensor_amax: tensors[{i}] has dtype {t.dtype}; supported: "
                               f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")


def _multi_tensor_amax_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    _check(tensors)
    if not tensors:
        return torch.empty(0, dtype=torch.float32)
    with torch.no_grad():
        return torch.stack([t.abs().amax().float() if t.numel() else
                            torch.zeros((), dtype=torch.float32, device=t.device) for t in tensors])


def multi_tensor_amax(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """max(|t|) of every tensor as one float32 tensor of len(tensors), on their device."""
    tensors = list(tensors)
    if not tensors:
        return torch.empty(0, dtype=torch.float32)
    device = tensors[0].device.type
    if extension_serves(device):
        return _load_extension().multi_tensor_amax(tensors)
    return _multi_tensor_amax_reference(tensors)
