"""The fp8 GEMM both fp8 linears call, and the rules of its operands.

torch._scaled_mm(a, b) takes `a` row-major and `b` column-major, both fp8,
with float32 inverse scales: one each (per tensor) or one per row of `a`
([M, 1]) and per column of `b` ([1, N]) (rowwise). On CUDA every operand
dimension must be a multiple of GEMM_ALIGNMENT.

On the CPU the same product is computed as a float32 matmul of the fp8
values (exact in float32: products of 4-bit mantissas), then the scales:
what torch's CPU `_scaled_mm` computes, up to the order of the float32 sums,
hundreds of times faster (a 256 x 512 x 384 GEMM: 2 ms against 1.9 s on 2
cores). The CUDA kernel's operand rules are checked there all the same, so
CPU runs still predict GPU ones.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from .. import _torch_compat

GEMM_ALIGNMENT = 16


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_operands(a, b, inv_scale_a, inv_scale_b) -> None:
    """torch._scaled_mm's rules on CUDA (where breaking one is an error), for the CPU's GEMM."""
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise RuntimeError(f"fp8 GEMM: operands must be float8, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 2 or a.size(1) != b.size(0):
        raise RuntimeError(f"fp8 GEMM: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    if not a.is_contiguous() or not b.t().is_contiguous():
        raise RuntimeError("fp8 GEMM: the first operand must be row-major and the second column-major, got "
                           f"strides {a.stride()} and {b.stride()}")
    for name, scale, rows in (("a", inv_scale_a, (a.size(0), 1)), ("b", inv_scale_b, (1, b.size(1)))):
        if scale.numel() != 1 and tuple(scale.shape) != rows:
            raise RuntimeError(f"fp8 GEMM: the scale of {name} must have one element or shape {rows}, "
                               f"got {tuple(scale.shape)}")


def scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, out=None):
    inv_scale_a, inv_scale_b = inv_scale_a.float(), inv_scale_b.float()
    if a.device.type != "cpu":
        return _torch_compat.scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, out=out)
    _check_operands(a, b, inv_scale_a, inv_scale_b)
    result = ((a.float() @ b.float()) * inv_scale_a * inv_scale_b).to(out_dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def scaled_mm_shaped(a, b, inv_scale_a, inv_scale_b, out_dtype, shape) -> torch.Tensor:
    """a @ b as a new tensor of `shape` (a's rows unflattened) that is no view: FSDP warns
    about module outputs that are views. Eagerly the GEMM writes into it (`out=`); traced by
    torch.compile, whose fake tensors have no `out=` variant of the GEMM, it is reshaped."""
    if torch.compiler.is_compiling():
        return scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype).view(shape)
    out = torch.empty(shape, dtype=out_dtype, device=a.device)
    scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, out=out.view(-1, b.size(1)))
    return out


@lru_cache(maxsize=None)
def _rowwise_error(device: torch.device, a_dtype: torch.dtype, b_dtype: torch.dtype,
                   out_dtype: torch.dtype) -> Optional[str]:
    n = GEMM_ALIGNMENT
    a = torch.zeros(n, n, device=device).to(a_dtype)
    b = torch.zeros(n, n, device=device).to(b_dtype).t()
    try:
        scaled_mm(a, b, torch.ones(n, 1, device=device), torch.ones(1, n, device=device), out_dtype)
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return None


def check_rowwise_support(device: torch.device, out_dtype: torch.dtype, forward_dtype: torch.dtype,
                          backward_dtype: torch.dtype) -> None:
    """Raise, naming what this torch supports, unless the fp8 GEMM on `device` takes row scales
    for the three GEMMs of an fp8 linear (a tiny GEMM of each operand pairing, once): there
    torch._scaled_mm, which may not; on the CPU our own GEMM, which does."""
    device = torch.device(device)
    pairs = {(forward_dtype, forward_dtype), (backward_dtype, forward_dtype)}
    for a_dtype, b_dtype in sorted(pairs, key=str):
        error = _rowwise_error(device, a_dtype, b_dtype, out_dtype)
        if error is not None:
            raise NotImplementedError(
                f"fp8_recipe='rowwise' needs torch._scaled_mm with row scales on {device.type} for "
                f"{a_dtype} x {b_dtype} -> {out_dtype}, which torch {torch.__version__} does not have here "
                f"({error}); supported here: fp8_recipe='tensorwise' or 'delayed'")
