"""Per-tensor fp8 scaling: scales from amaxes, saturating casts, amax histories.

A tensor x is stored as fp8(clamp(x * scale, -max, max)) and read back as
fp8 / scale. The scale puts the tensor's amax at the format's largest value:
scale = finfo(fp8).max / amax / 2**margin, computed in float64 and rounded
to float32 (Transformer Engine's and torchao's formula). An amax of zero
(an all-zero tensor) or a non-finite amax keeps the previous scale (1.0 at
first), as Transformer Engine does.

Casts always clamp first: float32 -> float8_e5m2 overflows to inf, and on
CUDA float8_e4m3fn turns out-of-range values into NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.fp8_cast import cast_to_fp8 as cast_to_fp8_bytes
from ..kernels.fp8_cast import cast_transpose_to_fp8 as cast_transpose_to_fp8_bytes

_FLOAT32_MAX = torch.finfo(torch.float32).max


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a float32 0-d tensor on x's device (0 for an empty tensor, NaN if x holds one)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    lo, hi = torch.aminmax(x.detach())
    return torch.maximum(hi, -lo).float()


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0,
                    previous: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 scale(s) mapping `amax` to the largest `dtype` value, 2**-margin below it.

    Works elementwise on a tensor of amaxes; where an amax is 0 or not
    finite the result is `previous` (or 1.0).
    """
    a = amax.double()
    scale = torch.full_like(a, fp8_max(dtype)) / a / (2.0 ** margin)
    fallback = torch.ones_like(a) if previous is None else previous.to(device=a.device, dtype=torch.float64)
    scale = torch.where(torch.isfinite(a) & (a > 0), scale, fallback)
    # A denormal amax would give a scale beyond float32: keep the largest finite one.
    return scale.clamp(max=_FLOAT32_MAX).float()


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Saturating cast: fp8(clamp(float32(x) * scale, -max, max)), in one pass
    (kernels.fp8_cast). `out`: a contiguous uint8 tensor of x.numel() elements
    to write the bytes into. Returns the fp8 tensor (a view of `out` when given)."""
    return cast_to_fp8_bytes(x.detach().contiguous(), scale, dtype, out=out).view(dtype)


def cast_transpose_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                          pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The saturating cast of a 2-D x [M, K] in both layouts from one read (kernels.fp8_cast):
    (fp8 x [M, K], fp8 x^T [K, M rounded up to pad_rows_to, zero beyond M], max |x| as a float32
    0-d tensor). `x^T.t()` is the column-major operand torch._scaled_mm takes second."""
    data, data_t, amax = cast_transpose_to_fp8_bytes(x.detach(), scale, dtype, pad_rows_to=pad_rows_to)
    return data.view(dtype), data_t.view(dtype), amax.reshape(())


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() / scale).to(dtype)


class AmaxHistory:
    """Delayed scaling state of one tensor role (a linear's input or output gradient).

    Each cast records the tensor's amax into `pending` (the running max since
    the last update). `update(amax)` shifts the history, puts the (globally
    reduced) pending amax first and derives the scale from the history with
    the compute algorithm. Until a first update has seen a recorded amax,
    casts use the tensor's current amax: the first step (or a resume
    without saved fp8 state) is not cast with an arbitrary scale.
    Tensors are created on first use, on the device of the tensor cast, or
    ahead of it by `materialize` (what a compiled layer needs: see
    linear.Fp8LinearState.materialize); later loads and resets change them in
    place, never replace them.
    """

    def __init__(self, history_len: int, compute_algo: str, dtype: torch.dtype, margin: int):
        self.history_len = history_len
        self.compute_algo = compute_algo
        self.dtype = dtype
        self.margin = margin
        self.amax_history: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        self.pending: Optional[torch.Tensor] = None
        self.calibrated = False
        self._recorded = False

    def materialize(self, device: torch.device) -> None:
        if self.amax_history is None:
            self.amax_history = torch.zeros(self.history_len, dtype=torch.float32, device=device)
            self.scale = torch.ones((), dtype=torch.float32, device=device)
            self.pending = torch.zeros((), dtype=torch.float32, device=device)

    def record(self, amax: torch.Tensor) -> None:
        self.materialize(amax.device)
        # detach: the history is never part of autograd, and torch 2.11's torch.compile traces the
        # fp8 linear's amax output as requiring grad (mark_non_differentiable notwithstanding),
        # which maximum(out=...) refuses.
        torch.maximum(self.pending, amax.detach(), out=self.pending)
        self._recorded = True

    def pending_amax(self, device: torch.device) -> torch.Tensor:
        self.materialize(device)
        return self.pending

    def update(self, amax: torch.Tensor) -> None:
        """Fold the reduced amax of the last step into the history and the scale.

        A non-finite amax (an overflowing step, which fp16 skips) leaves both as they were: an
        inf kept in the history would freeze the scale for history_len steps ("max") and reach
        checkpoints. Once calibrated this is decided on the device, so a step reads nothing
        back; before, whether the first amax is finite decides how the next step casts (current
        scaling or the history's), which the host must know: one read per warm-up step."""
        self.materialize(amax.device)
        if not self.calibrated and not bool(torch.isfinite(amax).all()):
            self.pending.zero_()
            return
        finite = torch.isfinite(amax)
        shifted = torch.cat((amax.reshape(1).to(self.amax_history.dtype), self.amax_history[:-1]))
        self.amax_history.copy_(torch.where(finite, shifted, self.amax_history))
        chosen = self.amax_history[0] if self.compute_algo == "most_recent" else self.amax_history.max()
        scale = scale_from_amax(chosen, self.dtype, self.margin, previous=self.scale)
        self.scale.copy_(torch.where(finite, scale, self.scale))
        self.pending.zero_()
        self.calibrated = self.calibrated or self._recorded

    def state_dict(self) -> dict:
        if self.amax_history is None or not (self.calibrated or self._recorded):
            return {}  # nothing recorded yet (materialized ahead or not): a fresh history
        return {"amax_history": self.amax_history.detach().cpu().clone(), "scale": self.scale.detach().cpu().clone()}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Restore a saved history ({}: start afresh); a saved history of
        another length is cut or zero-padded at its old end."""
        if not state:
            if self.amax_history is not None:
                self.amax_history.zero_()
                self.scale.fill_(1.0)
                self.pending.zero_()
            self.calibrated = self._recorded = False
            return
        self.materialize(device)
        saved = state["amax_history"].to(device=device, dtype=torch.float32)
        n = min(saved.numel(), self.history_len)
        self.amax_history.zero_()
        self.amax_history[:n] = saved[:n]
        self.scale.copy_(state["scale"].to(device=device, dtype=torch.float32))
        self.pending.zero_()
        self.calibrated = bool(self.amax_history.max() > 0)
        self._recorded = self.calibrated
