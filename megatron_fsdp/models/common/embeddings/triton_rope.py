"""RoPE's rotation as one Triton kernel each way (CUDA tensors; rotary_pos_embedding.py keeps
the eager path for the CPU).

For t [s, b, heads, head_dim] and the first `rot` channels of each head, forward computes
`t * cos + rotate_half(t) * sin`, backward `g * cos + rotate_half^T(g * sin)`, the other
channels passed through, with the numerics of Megatron's two paths:

  fused=True (`apply_rope_fusion`, Transformer Engine's fused RoPE): fp32 arithmetic with fp32
    cos/sin, rounded once to t's dtype;
  fused=False (Megatron's unfused `_apply_rotary_pos_emb_bshd`): cos/sin rounded to t's dtype
    and every product and the sum rounded to it, as the eager ops (and their autograd) round.

The eager path reads and writes t about six times each way (a cast, two products, the halves'
negation and concatenation, the sum); a kernel reads t (or the gradient) and writes the result
once, from any strides with a unit last one. cos and sin ([s, rot], computed by torch from the
fp32 angles, as the eager path computes them) are the only other reads.

The kernels are torch.library.triton_op operators (megatron_fsdp::rope_fwd, ::rope_bwd), so
torch.compile sees through them. Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from ...._triton_launch import traceable

_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, B, H, stride_s, stride_b, stride_h, D, ROT,
                 FUSED: tl.constexpr, BACKWARD: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    j = tl.arange(0, BLOCK_D)
    half = ROT // 2
    row_in = rows < n_rows
    pos = rows // (B * H)  # the sequence position: cos and sin's row
    src = pos * stride_s + (rows // H % B) * stride_b + (rows % H) * stride_h
    in_row = row_in[:, None] & (j < D)[None, :]
    rot = row_in[:, None] & (j < ROT)[None, :]
    first = (j < half)[None, :]
    partner = tl.where(j < half, j + half, j - half)  # the other half's channel
    x = tl.load(x_ptr + src[:, None] + j[None, :], mask=in_row, other=0.0)
    xp = tl.load(x_ptr + src[:, None] + partner[None, :], mask=rot, other=0.0).to(tl.float32)
    cs = pos[:, None] * ROT
    c = tl.load(cos_ptr + cs + j[None, :], mask=rot, other=0.0).to(tl.float32)
    if BACKWARD:
        # rotate_half^T(g * sin): g[j + half] * sin[j + half] in the first half, -g[j - half] *
        # sin[j - half] in the second.
        sp = tl.load(sin_ptr + cs + partner[None, :], mask=rot, other=0.0).to(tl.float32)
        other = tl.where(first, xp * sp, -(xp * sp))
    else:
        # rotate_half(x) * sin: -x[j + half] * sin[j] in the first half, x[j - half] * sin[j] in the second.
        s = tl.load(sin_ptr + cs + j[None, :], mask=rot, other=0.0).to(tl.float32)
        other = tl.where(first, -xp, xp) * s
    own = x.to(tl.float32) * c
    if not FUSED:  # each product rounded to the dtype, as the eager ops round
        own = own.to(out_ptr.dtype.element_ty).to(tl.float32)
        other = other.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = tl.where(rot, own + other, x.to(tl.float32))
    out = rows[:, None] * D + j[None, :]
    tl.store(out_ptr + out, y.to(out_ptr.dtype.element_ty), mask=in_row)


def _check(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool, name: str) -> None:
    if t.dim() != 4:
        raise ValueError(f"{name}: expected t of shape [s, b, heads, head_dim], got {tuple(t.shape)}")
    s, rot = t.size(0), cos.size(-1)
    if tuple(cos.shape) != (s, rot) or tuple(sin.shape) != (s, rot):
        raise ValueError(f"{name}: cos and sin must have shape ({s}, rot), got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")
    if rot % 2 or not 0 < rot <= t.size(-1):
        raise ValueError(f"{name}: the rotated channels ({rot}) must be even and at most head_dim ({t.size(-1)})")
    want = torch.float32 if fused else t.dtype
    if cos.dtype != want or sin.dtype != want:
        raise ValueError(f"{name}: fused={fused} takes cos and sin in {want}, got {cos.dtype} and {sin.dtype}")


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool, backward: bool) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    S, B, H, D = t.shape
    out = torch.empty((S, B, H, D), dtype=t.dtype, device=t.device)
    n_rows = S * B * H
    if n_rows:
        block_d = triton.next_power_of_2(D)
        rows = max(1, _ELEMENTS_PER_PROGRAM // block_d)
        traceable(_rope_kernel)[(triton.cdiv(n_rows, rows),)](
            t, cos.contiguous(), sin.contiguous(), out, n_rows, B, H, t.stride(0), t.stride(1), t.stride(2), D,
            cos.size(-1), FUSED=fused, BACKWARD=backward, ROWS=rows, BLOCK_D=block_d)
    return out


@triton_op("megatron_fsdp::rope_fwd", mutates_args=())
def rope_fwd(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """t [s, b, heads, head_dim] with its first cos.size(-1) channels rotated (cos, sin: [s, rot])."""
    _check(t, cos, sin, fused, "rope_fwd")
    return _rotate(t, cos, sin, fused, backward=False)


@triton_op("megatron_fsdp::rope_bwd", mutates_args=())
def rope_bwd(grad_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """The gradient of rope_fwd's t from its output's gradient."""
    _check(grad_out, cos, sin, fused, "rope_bwd")
    return _rotate(grad_out, cos, sin, fused, backward=True)
