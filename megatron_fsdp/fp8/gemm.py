"""The fp8 GEMM both fp8 linears call, and the rules of its operands.

torch._scaled_mm(a, b) takes `a` row-major and `b` column-major, both fp8,
with float32 inverse scales: one each (per tensor) or one per row of `a`
([M, 1]) and per column of `b` ([1, N]) (rowwise). On CUDA every operand
dimension must be a multiple of GEMM_ALIGNMENT.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

from .. import _torch_compat

GEMM_ALIGNMENT = 16


def scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, out=None):
    return _torch_compat.scaled_mm(a, b, inv_scale_a.float(), inv_scale_b.float(), out_dtype, out=out)


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
    """Raise, naming what this torch supports, unless torch._scaled_mm on `device` takes row
    scales for the three GEMMs of an fp8 linear (a tiny GEMM of each operand pairing, once)."""
    device = torch.device(device)
    pairs = {(forward_dtype, forward_dtype), (backward_dtype, forward_dtype)}
    for a_dtype, b_dtype in sorted(pairs, key=str):
        error = _rowwise_error(device, a_dtype, b_dtype, out_dtype)
        if error is not None:
            raise NotImplementedError(
                f"fp8_recipe='rowwise' needs torch._scaled_mm with row scales on {device.type} for "
                f"{a_dtype} x {b_dtype} -> {out_dtype}, which torch {torch.__version__} does not have here "
                f"({error}); supported here: fp8_recipe='tensorwise' or 'delayed'")
