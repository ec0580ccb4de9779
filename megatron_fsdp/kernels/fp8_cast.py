"""Scaled, saturating casts to fp8 bytes in one pass: `cast_to_fp8` (fp8 all-gather
inputs) and `cast_transpose_to_fp8` (fp8 GEMM operands, both layouts and the amax).

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

`cast_transpose_to_fp8(src, scale, dtype, pad_rows_to=1)` reads a 2-D src
[M, K] once and returns (out [M, K], out_t [K, Mt], amax): the same fp8 bytes
row-major and transposed, and max |src| as float32 (what delayed scaling
records). out is the row-major first operand of torch._scaled_mm, and
`out_t.t()` the column-major second one, so no transpose is made contiguous
afterwards. Mt is M rounded up to `pad_rows_to`, and the extra columns of
out_t are zero bytes (+0.0): the token padding of the weight-gradient GEMM.
(Transformer Engine calls this a cast-transpose.)
"""

from __future__ import annotations

from typing import Optional

import torch

from .extension import extension_serves

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _cast_to_fp8_reference(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor) -> None:
    fp8_max = FP8_MAX[dtype]
    with torch.no_grad():
        cast = (src.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
        out.view(-1).copy_(cast.reshape(-1).view(torch.uint8))


def _check_fallback_inputs(op: str, src: torch.Tensor, scale: torch.Tensor) -> None:
    """The kernels' checks of src and scale, for the PyTorch fallback (same words)."""
    if src.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise RuntimeError(f"{op}: src has dtype {src.dtype}; supported: float32, bfloat16, float16, float64")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise RuntimeError(f"{op}: scale must be a one-element float32 tensor, got {scale.dtype} with "
                           f"{scale.numel()} elements")


def cast_to_fp8(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp8 bytes of src * scale, saturated; returns `out` (uint8, src's shape when allocated here)."""
    if dtype not in FP8_MAX:
        raise ValueError(f"cast_to_fp8: dtype must be one of {list(FP8_MAX)}, got {dtype}")
    if out is None:
        out = torch.empty(src.shape, dtype=torch.uint8, device=src.device)
    device = src.device.type
    if extension_serves(device):
        torch.ops.megatron_fsdp.cast_to_fp8(src.detach(), scale.detach(), dtype, out)
        return out
    _check_fallback_inputs("cast_to_fp8", src, scale)
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != src.numel():
        raise RuntimeError(f"cast_to_fp8: out must be a contiguous uint8 tensor of {src.numel()} elements (src's), "
                           f"got {out.dtype} of shape {list(out.shape)}")
    _cast_to_fp8_reference(src, scale, dtype, out)
    return out


def _cast_transpose_reference(src, scale, dtype, out, out_t, amax) -> None:
    rows = src.size(0)
    with torch.no_grad():
        cast = (src.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype).view(torch.uint8)
        out.copy_(cast)
        out_t[:, :rows].copy_(cast.t())
        out_t[:, rows:].zero_()
        amax.copy_(src.abs().amax().float() if src.numel() else torch.zeros((), device=src.device))


def cast_transpose_to_fp8(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                          pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 bytes of src * scale [M, K], the same transposed [K, M rounded up to pad_rows_to],
    max |src| as a one-element float32 tensor), from one read of src; see the module's text."""
    if dtype not in FP8_MAX:
        raise ValueError(f"cast_transpose_to_fp8: dtype must be one of {list(FP8_MAX)}, got {dtype}")
    if isinstance(pad_rows_to, bool) or not isinstance(pad_rows_to, int) or pad_rows_to < 1:
        raise ValueError(f"cast_transpose_to_fp8: pad_rows_to must be a positive int, got {pad_rows_to!r}")
    if src.dim() != 2:
        raise ValueError(f"cast_transpose_to_fp8: src must be 2-D [M, K], got shape {list(src.shape)}")
    rows, cols = src.shape
    out = torch.empty((rows, cols), dtype=torch.uint8, device=src.device)
    out_t = torch.empty((cols, -(-rows // pad_rows_to) * pad_rows_to), dtype=torch.uint8, device=src.device)
    amax = torch.empty(1, dtype=torch.float32, device=src.device)
    device = src.device.type
    if extension_serves(device):
        torch.ops.megatron_fsdp.cast_transpose_to_fp8(src.detach(), scale.detach(), dtype, out, out_t, amax)
        return out, out_t, amax
    _check_fallback_inputs("cast_transpose_to_fp8", src, scale)
    _cast_transpose_reference(src, scale.reshape(()), dtype, out, out_t, amax)
    return out, out_t, amax
