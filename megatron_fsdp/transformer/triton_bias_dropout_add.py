"""Megatron's fused bias-dropout-add, residual + dropout(x + bias), as one Triton kernel each way
(CUDA tensors; transformer_layer.bias_dropout_add keeps the eager path for the CPU).

With bias_dropout_fusion Megatron computes it in fp32 and rounds once (its compiled function);
the eager path does that in about six passes over fp32 copies of x, the bias and the residual.
A kernel reads x, the residual (and the bias) once and writes the output once; backward reads
the output gradient once and writes x's (the residual's gradient is the output gradient itself).

Dropout keeps an element with probability 1 - p and scales it by 1 / (1 - p), the mask drawn by
Philox from a seed that forward draws from the device's torch generator (one int64, no host
sync). So the generator's state decides the mask, as it decides F.dropout's: a forward rerun from
the same state (activation recomputation, the tensor-parallel RNG tracker's forks) draws the same
mask, and backward regenerates it from the saved seed instead of keeping a mask tensor. The masks
differ from F.dropout's, as Megatron's compiled function's do.

The kernels are torch.library.triton_op operators (megatron_fsdp::bias_dropout_add_fwd, ::..._bwd),
so torch.compile sees through them. Importing this module needs Triton.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .._triton_launch import traceable

_BLOCK = 1024


@triton.jit
def _bda_fwd_kernel(x_ptr, bias_ptr, residual_ptr, seed_ptr, out_ptr, H, p, scale, HAS_BIAS: tl.constexpr,
                    P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < H
    i = row * H + j
    y = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + j, mask=mask, other=0.0).to(tl.float32)
    if P:  # kept with probability 1 - p
        y = tl.where(tl.rand(tl.load(seed_ptr), i) >= p, y * scale, 0.0)
    r = tl.load(residual_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (r + y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bda_bwd_kernel(g_ptr, seed_ptr, dx_ptr, H, p, scale, P: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < H
    i = row * H + j
    g = tl.load(g_ptr + i, mask=mask, other=0.0).to(tl.float32)
    if P:  # forward's mask, drawn again
        g = tl.where(tl.rand(tl.load(seed_ptr), i) >= p, g * scale, 0.0)
    tl.store(dx_ptr + i, g.to(dx_ptr.dtype.element_ty), mask=mask)


def _check(name: str, x: torch.Tensor, bias: Optional[torch.Tensor], p: float) -> int:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name}: dropout probability {p}, allowed: 0 <= p < 1")
    if x.dim() == 0:
        raise ValueError(f"{name}: x must have at least one dimension")
    H = x.shape[-1]
    if bias is not None and tuple(bias.shape) != (H,):
        raise ValueError(f"{name}: bias has shape {tuple(bias.shape)}, expected ({H},)")
    return H


def _grid(n: int, H: int):
    block = min(_BLOCK, triton.next_power_of_2(H))
    return (n // H, triton.cdiv(H, block)), block


@triton_op("megatron_fsdp::bias_dropout_add_fwd", mutates_args=())
def bias_dropout_add_fwd(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, seed: torch.Tensor,
                         p: float) -> torch.Tensor:
    """residual + dropout(x + bias) in fp32, rounded once to the residual's dtype; `seed`: one int64
    on x's device (read only when p > 0)."""
    H = _check("bias_dropout_add_fwd", x, bias, p)
    if residual.shape != x.shape:
        raise ValueError(f"bias_dropout_add_fwd: residual has shape {tuple(residual.shape)}, expected "
                         f"{tuple(x.shape)}")
    x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty_like(residual)
    if out.numel() and H:
        grid, block = _grid(out.numel(), H)
        traceable(_bda_fwd_kernel)[grid](
            x, x if bias is None else bias.contiguous(), residual, seed, out, H, p, 1.0 / (1.0 - p),
            HAS_BIAS=bias is not None, P=p > 0, BLOCK=block)
    return out


@triton_op("megatron_fsdp::bias_dropout_add_bwd", mutates_args=())
def bias_dropout_add_bwd(grad_out: torch.Tensor, seed: torch.Tensor, p: float,
                         dtype: torch.dtype) -> torch.Tensor:
    """The gradient of x + bias (in `dtype`) from the output's: grad_out where forward's mask kept,
    times 1 / (1 - p), zero where it dropped."""
    H = _check("bias_dropout_add_bwd", grad_out, None, p)
    grad_out = grad_out.contiguous()
    dx = torch.empty(grad_out.shape, dtype=dtype, device=grad_out.device)
    if dx.numel() and H:
        grid, block = _grid(dx.numel(), H)
        traceable(_bda_bwd_kernel)[grid](grad_out, seed, dx, H, p, 1.0 / (1.0 - p), P=p > 0, BLOCK=block)
    return dx
