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
(cast with its current amax).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .. import _torch_compat
from .recipe import Fp8Recipe
from .scaling import AmaxHistory, cast_to_fp8, scale_from_amax, tensor_amax
from .weight import Fp8GatheredWeight, Fp8TrainingWeight

GEMM_ALIGNMENT = 16


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


def _quantize(x: torch.Tensor, history: Optional[AmaxHistory], dtype: torch.dtype, margin: int, record: bool):
    """(fp8 x, inverse scale): current scaling, or the history's scale once it has one."""
    amax = tensor_amax(x)
    if history is not None:
        if record:
            history.record(amax)
        if history.calibrated:
            return cast_to_fp8(x, history.scale, dtype), history.scale.reciprocal()
    scale = scale_from_amax(amax, dtype, margin)
    return cast_to_fp8(x, scale, dtype), scale.reciprocal()


def _weight_fp8(weight: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [out, in], its scale)."""
    if isinstance(weight, Fp8GatheredWeight):
        return weight._data, weight._scale
    if isinstance(weight, Fp8TrainingWeight):
        data, scale = weight.cast_to_fp8()
        return data, scale.clone()  # refresh_fp8_scales updates the weight's scale in place
    scale = scale_from_amax(tensor_amax(weight), recipe.forward_dtype, recipe.margin)
    return cast_to_fp8(weight, scale, recipe.forward_dtype), scale


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix, laid out column-major (the second operand of _scaled_mm)."""
    return t.t().contiguous().t()


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.size(0) % multiple
    if not extra:
        return t
    # F.pad does not take float8: pad the bytes (a zero byte is +0.0 in both formats).
    return F.pad(t.view(torch.uint8), (0, 0, 0, extra)).view(t.dtype)


def _scaled_mm(a, b, inv_scale_a, inv_scale_b, out_dtype, out=None):
    return _torch_compat.scaled_mm(a, b, inv_scale_a.float(), inv_scale_b.float(), out_dtype, out=out)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, state: Fp8LinearState, record: bool):
        recipe = state.recipe
        x2 = x.reshape(-1, x.size(-1))
        xq, x_inv = _quantize(x2, state.input, recipe.forward_dtype, recipe.margin, record=record)
        wq, w_scale = _weight_fp8(weight, recipe)
        # Written through a 2-D view of the output: the output itself is no
        # view (FSDP warns about module outputs that are views).
        out = torch.empty((*x.shape[:-1], wq.size(0)), dtype=x.dtype, device=x.device)
        _scaled_mm(xq, wq.t(), x_inv, w_scale.reciprocal(), x.dtype, out=out.view(-1, wq.size(0)))
        ctx.state = state
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        # A gathered weight is saved as itself: FSDP frees its bytes after
        # forward and refills the same storage (and scale) before backward.
        saved_w = (weight,) if isinstance(weight, Fp8GatheredWeight) else (wq, w_scale)
        saved_x = (xq, x_inv) if recipe.wgrad else (x2,)
        ctx.num_w = len(saved_w)
        ctx.save_for_backward(*saved_w, *saved_x)
        return out

    @staticmethod
    def backward(ctx, grad):
        state, recipe = ctx.state, ctx.state.recipe
        saved = ctx.saved_tensors
        saved_w, saved_x = saved[:ctx.num_w], saved[ctx.num_w:]
        wq, w_scale = (saved_w[0]._data, saved_w[0]._scale) if ctx.num_w == 1 else saved_w
        g2 = grad.reshape(-1, grad.size(-1))
        gq, g_inv = _quantize(g2, state.grad_output, recipe.backward_dtype, recipe.margin, record=True)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _scaled_mm(gq, _column_major(wq), g_inv, w_scale.reciprocal(), ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad:
                xq, x_inv = saved_x
                g_t = _pad_rows(gq, GEMM_ALIGNMENT).t().contiguous()
                x_pad = _pad_rows(xq, GEMM_ALIGNMENT)
                dw = _scaled_mm(g_t, _column_major(x_pad), g_inv, x_inv, ctx.w_dtype)
            else:
                (x2,) = saved_x
                dw = (g2.t() @ x2.to(g2.dtype)).to(ctx.w_dtype)
        return dx, dw, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, state: Fp8LinearState) -> torch.Tensor:
    """x @ weight^T (no bias) with fp8 GEMMs; `weight` is a local [out, in] tensor."""
    # Forwards without autograd (evaluation, the first pass of activation
    # recompute) leave the delayed-scaling histories to training forwards.
    return _Fp8Linear.apply(x, weight, state, torch.is_grad_enabled())
