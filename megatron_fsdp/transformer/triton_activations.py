"""Megatron's fused bias-GELU, bias-GeGLU and bias-SwiGLU as one Triton kernel
each way (CUDA tensors; fused_activations.py keeps the eager path for the CPU).

Each element is computed in fp32 from the input (and bias) and rounded to the
input dtype once, with Megatron's formulas and closed-form derivatives (the
constants are gelu_constants'); backward reads the saved fc1 output and
the incoming gradient and writes the fc1 gradient in one pass, gate and up
together. So a gated activation costs one read of fc1's output and one write
of half its size forward, one read of each and one write of fc1's size
backward: nothing is cast, stacked or interleaved in between.

Gated inputs hold fc1's output in Megatron-Core's layout: gate at column j,
up at F + j of each row of C = 2F columns.

The kernels are torch.library.triton_op operators (megatron_fsdp::bias_act_fwd
and ::bias_act_bwd), so torch.compile sees through them. Importing this module
needs Triton; fused_activations imports it only for a CUDA tensor.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .._triton_launch import traceable
from .gelu_constants import CUBIC as _CUBIC, CUBIC_GRAD as _CUBIC_GRAD, SQRT_2_OVER_PI as _SQRT_2_OVER_PI

# kind codes (constexpr in the kernels)
GELU, GEGLU, SWIGLU = 0, 1, 2
CODES = {"gelu": GELU, "geglu": GEGLU, "swiglu": SWIGLU}
_BLOCK = 1024


@triton.jit
def _gelu_and_grad(x, SQRT_2_OVER_PI: tl.constexpr, CUBIC: tl.constexpr, CUBIC_GRAD: tl.constexpr):
    """Megatron's tanh GELU and its closed-form derivative, with t = tanh(z) entering only as
    1 + t and 1 - t^2, each computed from e = exp(-2|z|) without cancellation (Triton has no
    tanh of its own, and 1 - t * t loses the digits where |t| nears 1)."""
    z = SQRT_2_OVER_PI * x * (1.0 + CUBIC * x * x)
    e = tl.exp(-2.0 * tl.abs(z))  # in (0, 1]: never overflows
    r = 1.0 / (1.0 + e)
    one_plus_t = tl.where(z >= 0, 2.0 * r, 2.0 * e * r)
    one_minus_t2 = 4.0 * e * r * r
    act = x * 0.5 * one_plus_t
    grad = 0.5 * x * (one_minus_t2 * (SQRT_2_OVER_PI + CUBIC_GRAD * x * x)) + 0.5 * one_plus_t
    return act, grad


@triton.jit
def _sigmoid(a):
    e = tl.exp(-tl.abs(a))  # never overflows
    return tl.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _offsets(row, j, F, C, KIND: tl.constexpr):
    """Output column j of a row -> (gate or input offset, up offset) in y, and their bias
    indices. From the row and column (a 2-D grid), not a flat index: no division per element."""
    base = row * C
    if KIND == 0:
        return base + j, base + j, j, j
    return base + j, base + F + j, j, F + j


@triton.jit
def _load_fp32(y_ptr, off, bias_ptr, bias_off, mask, HAS_BIAS: tl.constexpr):
    """y[off] (+ bias[bias_off]) in fp32."""
    x = tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + bias_off, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _bias_act_fwd_kernel(y_ptr, bias_ptr, out_ptr, F, C, KIND: tl.constexpr, HAS_BIAS: tl.constexpr, SQRT_2_OVER_PI: tl.constexpr, CUBIC: tl.constexpr,
                         CUBIC_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < F
    i = row * F + j  # the output's (and the output gradient's) offset
    a_off, b_off, a_bias, b_bias = _offsets(row, j, F, C, KIND)
    a = _load_fp32(y_ptr, a_off, bias_ptr, a_bias, mask, HAS_BIAS)
    if KIND == 2:
        act = a * _sigmoid(a)
    else:
        act, _ = _gelu_and_grad(a, SQRT_2_OVER_PI, CUBIC, CUBIC_GRAD)
    if KIND != 0:
        act = act * _load_fp32(y_ptr, b_off, bias_ptr, b_bias, mask, HAS_BIAS)
    tl.store(out_ptr + i, act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_act_bwd_kernel(g_ptr, y_ptr, bias_ptr, dy_ptr, F, C, KIND: tl.constexpr, HAS_BIAS: tl.constexpr, SQRT_2_OVER_PI: tl.constexpr, CUBIC: tl.constexpr,
                         CUBIC_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < F
    i = row * F + j  # the output's (and the output gradient's) offset
    a_off, b_off, a_bias, b_bias = _offsets(row, j, F, C, KIND)
    g = tl.load(g_ptr + i, mask=mask, other=0.0).to(tl.float32)
    a = _load_fp32(y_ptr, a_off, bias_ptr, a_bias, mask, HAS_BIAS)
    if KIND == 2:
        sig = _sigmoid(a)
        act = a * sig
        grad = sig * (1.0 + a * (1.0 - sig))
    else:
        act, grad = _gelu_and_grad(a, SQRT_2_OVER_PI, CUBIC, CUBIC_GRAD)
    if KIND == 0:
        tl.store(dy_ptr + a_off, (grad * g).to(dy_ptr.dtype.element_ty), mask=mask)
    else:
        b = _load_fp32(y_ptr, b_off, bias_ptr, b_bias, mask, HAS_BIAS)
        # Megatron's order: (g * up) * act'(gate) for the gate, g * act(gate) for up.
        tl.store(dy_ptr + a_off, ((g * b) * grad).to(dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dy_ptr + b_off, (g * act).to(dy_ptr.dtype.element_ty), mask=mask)


def _check(y: torch.Tensor, bias: Optional[torch.Tensor], kind: int) -> tuple[int, int]:
    if kind not in (GELU, GEGLU, SWIGLU):
        raise ValueError(f"bias_act: kind code {kind}, allowed: {CODES}")
    C = y.shape[-1]
    if kind != GELU and C % 2:
        raise ValueError(f"bias_act: a gated activation needs an even last dimension, got {tuple(y.shape)}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias_act: bias has shape {tuple(bias.shape)}, expected ({C},)")
    return C, C if kind == GELU else C // 2


def _launch(n: int, F: int):
    """(grid, block): one program per row and block of up to _BLOCK output columns."""
    block = min(_BLOCK, triton.next_power_of_2(F))
    return (n // F, triton.cdiv(F, block)), block


def _constants(block: int):
    return dict(SQRT_2_OVER_PI=_SQRT_2_OVER_PI, CUBIC=_CUBIC, CUBIC_GRAD=_CUBIC_GRAD, BLOCK=block)


@triton_op("megatron_fsdp::bias_act_fwd", mutates_args=())
def bias_act_fwd(y: torch.Tensor, bias: Optional[torch.Tensor], kind: int) -> torch.Tensor:
    """act(y + bias) for kind GELU, GEGLU or SWIGLU; gated: [..., C] -> [..., C / 2]."""
    C, F = _check(y, bias, kind)
    y = y.contiguous()
    out = torch.empty(*y.shape[:-1], F, dtype=y.dtype, device=y.device)
    n = out.numel()
    if n:
        grid, block = _launch(n, F)
        traceable(_bias_act_fwd_kernel)[grid](
            y, y if bias is None else bias.contiguous(), out, F, C, KIND=kind, HAS_BIAS=bias is not None, **_constants(block))
    return out


@triton_op("megatron_fsdp::bias_act_bwd", mutates_args=())
def bias_act_bwd(grad_out: torch.Tensor, y: torch.Tensor, bias: Optional[torch.Tensor],
                 kind: int) -> torch.Tensor:
    """d act(y + bias) / dy applied to grad_out: the gradient of y (summed over the tokens it is the bias's)."""
    C, F = _check(y, bias, kind)
    if tuple(grad_out.shape) != (*y.shape[:-1], F):
        raise ValueError(f"bias_act_bwd: grad_out has shape {tuple(grad_out.shape)}, expected "
                         f"{(*y.shape[:-1], F)}")
    y, grad_out = y.contiguous(), grad_out.contiguous()
    dy = torch.empty_like(y)
    n = grad_out.numel()
    if n:
        grid, block = _launch(n, F)
        traceable(_bias_act_bwd_kernel)[grid](
            grad_out, y, y if bias is None else bias.contiguous(), dy, F, C, KIND=kind,
            HAS_BIAS=bias is not None, **_constants(block))
    return dy
