"""The fp8 linear: y = x W^T with all three GEMMs through torch._scaled_mm.

Forward    y  = x  @ W^T    x: e4m3 (input role), W: e4m3
Input grad dx = dy @ W      dy: e5m2 under "hybrid", e4m3 under "e4m3"
Weight grad dW = dy^T @ x   fp8 with fp8_wgrad (the default), else in the
                            high precision of the inputs

Everything runs on local tensors (a tensor-parallel layer passes its shard).
Operands are laid out as torch._scaled_mm on CUDA requires (first operand
row-major, second column-major) on every device, so CPU runs test the GPU
code path. On CUDA its operand dimensions must also be multiples of 16:
the layers check the weight's (see `check_fp8_weight_shape`), and the weight
gradient GEMM zero-pads the token dimension (zeros add nothing). The result
and the gradients come out in the dtype of the input (y, dx) and of the
weight (dW); the bias is added by the caller.

The weight may be an `Fp8GatheredWeight` (gathered in fp8 by FSDP), an
`Fp8TrainingWeight` (cast with its precomputed scale) or a plain tensor
(cast with its current amax). The "rowwise" recipe has its own autograd
function (rowwise.py); this one scales per tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from .gemm import GEMM_ALIGNMENT, scaled_mm as _scaled_mm, scaled_mm_shaped
from .recipe import Fp8Recipe
from .rowwise import rowwise_fp8_linear
from .scaling import AmaxHistory, cast_to_fp8, cast_transpose_to_fp8, scale_from_amax, tensor_amax
from .weight import Fp8GatheredWeight, Fp8TrainingWeight

class Fp8LinearState:
    """The recipe of one fp8 linear and, under "delayed", the amax histories
    of its input and output gradient (see scaling.AmaxHistory)."""

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self.converted_weight = False  # set by convert_to_fp8_weights
        if recipe.delayed:
            self.input: Optional[AmaxHistory] = AmaxHistory(
                recipe.amax_history_len, recipe.amax_compute_algo, recipe.forward_dtype, recipe.margin)
            self.grad_output: Optional[AmaxHistory] = AmaxHistory(
                recipe.amax_history_len, recipe.amax_compute_algo, recipe.backward_dtype, recipe.margin)
        else:
            self.input = self.grad_output = None

    def histories(self) -> list[tuple[str, AmaxHistory]]:
        return [(name, h) for name, h in (("input", self.input), ("grad_output", self.grad_output)) if h is not None]


def _fp8_linears(module):
    """(name, module) of every module with fp8 state (the converted linears)."""
    return [(name, m) for name, m in module.named_modules() if getattr(m, "fp8_state", None) is not None]


def check_fp8_weight_shape(where: str, out_features: int, in_features: int) -> None:
    bad = [n for n in (out_features, in_features) if n % GEMM_ALIGNMENT]
    if bad:
        raise ValueError(
            f"{where}: an fp8 linear needs both dimensions of its local weight to be multiples of "
            f"{GEMM_ALIGNMENT} (torch._scaled_mm's rule on CUDA, enforced on every device), got "
            f"[out, in] = [{out_features}, {in_features}]; change the sizes or keep this layer in high "
            "precision (first_last_layers_bf16)")


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transposed: bool,
          pad_rows_to: int = 1) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(fp8 x [M, K], fp8 x^T [K, M padded to pad_rows_to] and max |x| if `transposed`, else None
    and None): the cast-transpose finds the amax on the way, the plain cast does not."""
    if transposed:
        return cast_transpose_to_fp8(x, scale, dtype, pad_rows_to=pad_rows_to)
    return cast_to_fp8(x, scale, dtype), None, None


def _quantize(x: torch.Tensor, history: Optional[AmaxHistory], dtype: torch.dtype, margin: int, record: bool,
              transposed: bool):
    """(fp8 x [M, K], fp8 x^T [K, M padded to GEMM_ALIGNMENT] if `transposed` else None, inverse
    scale): current scaling, or the history's scale once it has one. With the history's scale
    the cast-transpose reads x once and records the amax it found on the way; current scaling
    needs the amax before the cast, one read more."""
    if history is not None and history.calibrated:
        scale = history.scale
        data, data_t, amax = _cast(x, scale, dtype, transposed, GEMM_ALIGNMENT)
        if record:
            history.record(amax if amax is not None else tensor_amax(x))
        return data, data_t, scale.reciprocal()
    amax = tensor_amax(x)
    if history is not None and record:
        history.record(amax)
    scale = scale_from_amax(amax, dtype, margin)
    data, data_t, _ = _cast(x, scale, dtype, transposed, GEMM_ALIGNMENT)
    return data, data_t, scale.reciprocal()


def _weight_fp8(weight: torch.Tensor, recipe: Fp8Recipe,
                transposed: bool) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(fp8 weight [out, in], its transpose [in, out] if `transposed` (None for a gathered
    weight: see _Fp8Linear.backward), its scale)."""
    if isinstance(weight, Fp8GatheredWeight):
        return weight._data, None, weight._scale
    if isinstance(weight, Fp8TrainingWeight):
        scale = weight.fp8_scale()
        data, data_t, _ = _cast(weight._data, scale, weight._fp8_meta.fp8_dtype, transposed)
        return data, data_t, scale.clone()  # refresh_fp8_scales updates the weight's scale in place
    scale = scale_from_amax(tensor_amax(weight), recipe.forward_dtype, recipe.margin)
    data, data_t, _ = _cast(weight, scale, recipe.forward_dtype, transposed)
    return data, data_t, scale


class _Fp8Linear(torch.autograd.Function):
    """Every fp8 operand comes out of its cast in the layout its GEMMs take: the row-major
    copy for the first operand, the transposed copy (`.t()`: column-major) for the second. No
    transpose of an fp8 tensor is made contiguous, except the gathered weight's for the input
    gradient: FSDP gathers one layout, and Hopper's fp8 GEMM takes no other."""

    @staticmethod
    def forward(ctx, x, weight, state: Fp8LinearState, record: bool):
        recipe = state.recipe
        # `record`: autograd is on. Without it (evaluation) no backward comes: nothing to prepare.
        x_grad, w_grad = ctx.needs_input_grad[0] and record, ctx.needs_input_grad[1] and record
        wgrad_in_fp8 = recipe.wgrad and w_grad
        x2 = x.reshape(-1, x.size(-1))
        xq, xq_t, x_inv = _quantize(x2, state.input, recipe.forward_dtype, recipe.margin, record=record,
                                    transposed=wgrad_in_fp8)
        wq, wq_t, w_scale = _weight_fp8(weight, recipe, transposed=x_grad)
        out = scaled_mm_shaped(xq, wq.t(), x_inv, w_scale.reciprocal(), x.dtype, (*x.shape[:-1], wq.size(0)))
        ctx.state = state
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        # A gathered weight is saved as itself: FSDP frees its bytes after
        # forward and refills the same storage (and scale) before backward.
        saved_w = (weight,) if isinstance(weight, Fp8GatheredWeight) else (
            (wq_t, w_scale) if x_grad else ())
        saved_x = (xq_t, x_inv) if wgrad_in_fp8 else ((x2,) if w_grad else ())
        ctx.num_w = len(saved_w)
        ctx.save_for_backward(*saved_w, *saved_x)
        return out

    @staticmethod
    def backward(ctx, grad):
        state, recipe = ctx.state, ctx.state.recipe
        saved = ctx.saved_tensors
        saved_w, saved_x = saved[:ctx.num_w], saved[ctx.num_w:]
        x_grad, w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g2 = grad.reshape(-1, grad.size(-1))
        gq, gq_t, g_inv = _quantize(g2, state.grad_output, recipe.backward_dtype, recipe.margin, record=True,
                                    transposed=recipe.wgrad and w_grad)
        dx = dw = None
        if x_grad:
            if ctx.num_w == 1:  # the gathered weight [out, in]: its one transposed copy
                wq_t, w_scale = saved_w[0]._data.t().contiguous(), saved_w[0]._scale
            else:
                wq_t, w_scale = saved_w
            dx = _scaled_mm(gq, wq_t.t(), g_inv, w_scale.reciprocal(), ctx.x_dtype).view(ctx.x_shape)
        if w_grad:
            if recipe.wgrad:
                # dW = dy^T x over the tokens, zero-padded to GEMM_ALIGNMENT by the casts.
                xq_t, x_inv = saved_x
                dw = _scaled_mm(gq_t, xq_t.t(), g_inv, x_inv, ctx.w_dtype)
            else:
                (x2,) = saved_x
                dw = (g2.t() @ x2.to(g2.dtype)).to(ctx.w_dtype)
        return dx, dw, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, state: Fp8LinearState) -> torch.Tensor:
    """x @ weight^T (no bias) with fp8 GEMMs; `weight` is a local [out, in] tensor."""
    if state.recipe.rowwise:
        return rowwise_fp8_linear(x, weight, state.recipe)
    # Forwards without autograd (evaluation, the first pass of activation
    # recompute) leave the delayed-scaling histories to training forwards.
    return _Fp8Linear.apply(x, weight, state, torch.is_grad_enabled())
