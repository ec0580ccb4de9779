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
    of its input and output gradient (see scaling.AmaxHistory).

    The output gradient's amax is found in backward, and reaches its history
    as the gradient of `grad_output_sink`, a 0-d leaf tensor that the fp8 GEMMs
    take as an input: a post-accumulate-grad hook records it and drops it.
    So the autograd function mutates nothing, which lets torch.compile trace a
    layer whole (a history written from inside backward cannot be traced).
    """

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe
        self.converted_weight = False  # set by convert_to_fp8_weights
        self.grad_output_sink: Optional[torch.Tensor] = None
        if recipe.delayed:
            self.input: Optional[AmaxHistory] = AmaxHistory(
                recipe.amax_history_len, recipe.amax_compute_algo, recipe.forward_dtype, recipe.margin)
            self.grad_output: Optional[AmaxHistory] = AmaxHistory(
                recipe.amax_history_len, recipe.amax_compute_algo, recipe.backward_dtype, recipe.margin)
        else:
            self.input = self.grad_output = None

    def histories(self) -> list[tuple[str, AmaxHistory]]:
        return [(name, h) for name, h in (("input", self.input), ("grad_output", self.grad_output)) if h is not None]

    def materialize(self, device: torch.device) -> None:
        """Create the delayed-scaling tensors (histories, scales, the sink) on `device`; a no-op
        once done, and without delayed scaling. The first eager forward does it; a compiled
        layer's trace cannot create them, so the FSDP plan does it first (materialize_fp8_state)."""
        if self.input is None or self.grad_output_sink is not None:
            return
        if torch.compiler.is_compiling():
            raise RuntimeError("fp8 delayed scaling: a compiled layer's first run found its amax histories "
                               "not yet on a device; call megatron_fsdp.fp8.materialize_fp8_state(model, device) "
                               "before compiling (TorchFullyShardedDataParallel does)")
        for _, history in self.histories():
            history.materialize(device)
        history = self.grad_output
        sink = torch.zeros((), dtype=torch.float32, device=device, requires_grad=True)

        def record_grad_output_amax(tensor: torch.Tensor) -> None:
            history.record(tensor.grad)
            tensor.grad = None

        sink.register_post_accumulate_grad_hook(record_grad_output_amax)
        self.grad_output_sink = sink


def materialize_fp8_state(model: torch.nn.Module, device: torch.device) -> None:
    """Create every fp8 linear's delayed-scaling state on `device` (see Fp8LinearState.materialize)."""
    for _, linear in _fp8_linears(model):
        linear.fp8_state.materialize(device)


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


def _quantize(x: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype, margin: int,
              want_amax: bool, transposed: bool):
    """(fp8 x [M, K], fp8 x^T [K, M padded to GEMM_ALIGNMENT] if `transposed` else None, inverse
    scale, max |x| or None): cast with `scale` (a delayed-scaling history's), or with current
    scaling when it is None. With a given scale the cast-transpose finds the amax on the way,
    and a plain cast needs one read more for it (only when `want_amax`); current scaling needs
    the amax before the cast, and returns it."""
    if scale is not None:
        data, data_t, amax = _cast(x, scale, dtype, transposed, GEMM_ALIGNMENT)
        if want_amax and amax is None:
            amax = tensor_amax(x)
        return data, data_t, scale.reciprocal(), amax
    amax = tensor_amax(x)
    scale = scale_from_amax(amax, dtype, margin)
    data, data_t, _ = _cast(x, scale, dtype, transposed, GEMM_ALIGNMENT)
    return data, data_t, scale.reciprocal(), amax


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
    gradient: FSDP gathers one layout, and Hopper's fp8 GEMM takes no other.

    `input_scale`, `grad_output_scale`: delayed scaling's (None: current scaling).
    `grad_output_sink`: a 0-d leaf (or None) whose gradient is the output gradient's amax.
    Returns (y, max |x| for the input history: a zero when not `record`ed). Nothing outside
    the function is changed here: the caller records, so torch.compile traces it whole."""

    @staticmethod
    def forward(ctx, x, weight, input_scale, grad_output_scale, grad_output_sink, recipe: Fp8Recipe,
                record: bool):
        # `record`: autograd is on. Without it (evaluation) no backward comes: nothing to prepare.
        x_grad, w_grad = ctx.needs_input_grad[0] and record, ctx.needs_input_grad[1] and record
        wgrad_in_fp8 = recipe.wgrad and w_grad
        x2 = x.reshape(-1, x.size(-1))
        xq, xq_t, x_inv, x_amax = _quantize(x2, input_scale, recipe.forward_dtype, recipe.margin,
                                            want_amax=record and recipe.delayed, transposed=wgrad_in_fp8)
        wq, wq_t, w_scale = _weight_fp8(weight, recipe, transposed=x_grad)
        out = scaled_mm_shaped(xq, wq.t(), x_inv, w_scale.reciprocal(), x.dtype, (*x.shape[:-1], wq.size(0)))
        ctx.recipe = recipe
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.record_grad_amax = grad_output_sink is not None and record
        # A gathered weight is saved as itself: FSDP frees its bytes after
        # forward and refills the same storage (and scale) before backward.
        saved_w = (weight,) if isinstance(weight, Fp8GatheredWeight) else (
            (wq_t, w_scale) if x_grad else ())
        saved_x = (xq_t, x_inv) if wgrad_in_fp8 else ((x2,) if w_grad else ())
        saved_g = () if grad_output_scale is None else (grad_output_scale,)
        ctx.num_w, ctx.num_x = len(saved_w), len(saved_x)
        ctx.save_for_backward(*saved_w, *saved_x, *saved_g)
        if x_amax is None:
            x_amax = torch.zeros((), dtype=torch.float32, device=x.device)
        ctx.mark_non_differentiable(x_amax)
        return out, x_amax

    @staticmethod
    def backward(ctx, grad, _grad_amax):
        recipe = ctx.recipe
        saved = ctx.saved_tensors
        saved_w, saved_x = saved[:ctx.num_w], saved[ctx.num_w:ctx.num_w + ctx.num_x]
        saved_g = saved[ctx.num_w + ctx.num_x:]
        x_grad, w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g2 = grad.reshape(-1, grad.size(-1))
        gq, gq_t, g_inv, g_amax = _quantize(g2, saved_g[0] if saved_g else None, recipe.backward_dtype,
                                            recipe.margin, want_amax=ctx.record_grad_amax,
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
        return dx, dw, None, None, (g_amax if ctx.record_grad_amax else None), None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, state: Fp8LinearState) -> torch.Tensor:
    """x @ weight^T (no bias) with fp8 GEMMs; `weight` is a local [out, in] tensor."""
    recipe = state.recipe
    if recipe.rowwise:
        return rowwise_fp8_linear(x, weight, recipe)
    # Forwards without autograd (evaluation, the first pass of activation
    # recompute) leave the delayed-scaling histories to training forwards.
    record = torch.is_grad_enabled()
    if not recipe.delayed:
        return _Fp8Linear.apply(x, weight, None, None, None, recipe, record)[0]
    state.materialize(x.device)
    inputs, grads = state.input, state.grad_output
    sink = state.grad_output_sink if record and (x.requires_grad or weight.requires_grad) else None
    out, x_amax = _Fp8Linear.apply(x, weight, inputs.scale if inputs.calibrated else None,
                                   grads.scale if grads.calibrated else None, sink, recipe, record)
    if record:
        inputs.record(x_amax)
    return out
