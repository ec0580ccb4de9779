"""The fp8 linear under the "rowwise" recipe: every operand of every GEMM scaled per row of
its reduction (per token, per output feature, per input feature), from its current values.

Forward    y  = x  @ W^T   x per token, W per output feature
Input grad dx = dy @ W     dy per token, W per input feature (W^T's rows)
Weight grad dW = dy^T @ x  dy^T per output feature, x^T per input feature; the
                           token dimension zero-padded to GEMM_ALIGNMENT (with
                           fp8_wgrad; else in the inputs' high precision)

So x, dy and W are each cast twice, once along each dimension, each cast
written row-major (the transposed operands are `.t()` of those: column-major,
as torch._scaled_mm takes them). A row's scale is the format's largest value
over the row's amax (2**-margin below), 1.0 for a row of zeros; rows never
share an outlier's loss of precision. The casts are PyTorch expressions (no
fused kernel yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gemm import GEMM_ALIGNMENT, scaled_mm, scaled_mm_shaped
from .recipe import Fp8Recipe
from .scaling import fp8_max, scale_from_amax


def rowwise_cast(t: torch.Tensor, dtype: torch.dtype, margin: int,
                 pad_cols_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 t [R, C padded with zero columns to pad_cols_to], float32 inverse scales [R, 1]) of a
    2-D t in any layout, written row-major: each row cast with its own scale, saturating."""
    t = t.detach()
    extra = -t.size(1) % pad_cols_to
    if extra:
        t = F.pad(t, (0, extra))
    amax = t.abs().amax(dim=1, keepdim=True).float() if t.size(1) else torch.zeros(t.size(0), 1, device=t.device)
    scale = scale_from_amax(amax, dtype, margin)
    limit = fp8_max(dtype)
    data = (t.float() * scale).clamp(-limit, limit).to(dtype, memory_format=torch.contiguous_format)
    return data, scale.reciprocal()


class _RowwiseFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: Fp8Recipe, grad_enabled: bool):
        # Without autograd (evaluation) no backward comes: nothing to prepare for it.
        x_grad, w_grad = ctx.needs_input_grad[0] and grad_enabled, ctx.needs_input_grad[1] and grad_enabled
        fwd, margin = recipe.forward_dtype, recipe.margin
        x2 = x.reshape(-1, x.size(-1))
        xq, x_inv = rowwise_cast(x2, fwd, margin)
        wq, w_inv = rowwise_cast(weight, fwd, margin)
        out = scaled_mm_shaped(xq, wq.t(), x_inv, w_inv.t(), x.dtype, (*x.shape[:-1], wq.size(0)))
        # What backward reads, cast now (the weight is at hand; x in fp8 is a quarter of fp32).
        saved_w = rowwise_cast(weight.t(), fwd, margin) if x_grad else ()
        if w_grad and recipe.wgrad:
            saved_x = rowwise_cast(x2.t(), fwd, margin, pad_cols_to=GEMM_ALIGNMENT)
        else:
            saved_x = (x2,) if w_grad else ()
        ctx.recipe, ctx.num_w = recipe, len(saved_w)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.save_for_backward(*saved_w, *saved_x)
        return out

    @staticmethod
    def backward(ctx, grad):
        recipe = ctx.recipe
        saved = ctx.saved_tensors
        saved_w, saved_x = saved[:ctx.num_w], saved[ctx.num_w:]
        bwd, margin = recipe.backward_dtype, recipe.margin
        g2 = grad.reshape(-1, grad.size(-1))
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, g_inv = rowwise_cast(g2, bwd, margin)
            wq_t, w_t_inv = saved_w  # W^T [in, out], per input feature
            dx = scaled_mm(gq, wq_t.t(), g_inv, w_t_inv.t(), ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad:
                gq_t, g_t_inv = rowwise_cast(g2.t(), bwd, margin, pad_cols_to=GEMM_ALIGNMENT)
                xq_t, x_t_inv = saved_x
                dw = scaled_mm(gq_t, xq_t.t(), g_t_inv, x_t_inv.t(), ctx.w_dtype)
            else:
                (x2,) = saved_x
                dw = (g2.t() @ x2.to(g2.dtype)).to(ctx.w_dtype)
        return dx, dw, None, None


def rowwise_fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """x @ weight^T (no bias) with rowwise-scaled fp8 GEMMs; `weight` a local [out, in] tensor."""
    return _RowwiseFp8Linear.apply(x, weight, recipe, torch.is_grad_enabled())
