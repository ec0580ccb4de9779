"""Scaled, saturating cast to fp8 bytes in one pass (fp8 all-gather inputs).

`cast_to_fp8(src, scale, dtype, out=None)` writes the fp8 bit patterns of
`clamp(src.float() * scale, -max, max)` as uint8, `max` the largest finite
value of `dtype` (448 for float8_e4m3fn, 57344 for float8_e5m2): bitwise
`(src.float() * scale).clamp(-max, max).to(dtype).view(torch.uint8)`, without
its three temporaries. The clamp matters for e5m2, whose plain cast turns
overflow into inf; NaN stays NaN. `out` (a contiguous uint8 tensor of
src.numel() elements, e.g. a slice of an all-gather buffer) is written in
place; without it a new one is returned.

The kernels are `torch.ops.megatron_fsdp.cast_to_fp8` (CPU; CUDA when the
extension is built with it); elsewhere the PyTorch expression above runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from .extension import extension_available, extension_has_cuda

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _cast_to_fp8_reference(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    fp8_max = FP8_MAX[dtype]
    with torch.no_grad():
        cast = (src.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
        out.view(-1).copy_(cast.reshape(-1).view(torch.uint8))


def cast_to_fp8(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp8 bytes of src * scale, saturated; returns `out` (uint8, src's shape when allocated here)."""
    if dtype not in FP8_MAX:
        raise ValueError(f"cast_to_fp8: dtype must be one of {list(FP8_MAX)}, got {dtype}")
    if out is None:
        out = torch.empty(src.shape, dtype=torch.uint8, device=src.device)
    device = src.device.type
    if (device == "cpu" and extension_available()) or (device == "cuda" and extension_has_cuda()):
        torch.ops.megatron_fsdp.cast_to_fp8(src.detach(), scale.detach(), dtype, out)
        return out
    if src.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise RuntimeError(f"cast_to_fp8: src has dtype {src.dtype}; supported: float32, bfloat16, float16, float64")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise RuntimeError(f"cast_to_fp8: scale must be a one-element float32 tensor, got {scale.dtype} with "
                           f"{scale.numel()} elements")
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != src.numel():
        raise RuntimeError(f"cast_to_fp8: out must be a contiguous uint8 tensor of {src.numel()} elements (src's), "
                           f"got {out.dtype} of shape {list(out.shape)}")
    _cast_to_fp8_reference(src, scale, dtype, out)
    return out
