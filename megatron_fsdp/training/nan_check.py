"""`--check-for-nan-in-loss-and-grad`: a NaN/inf on any rank stops every rank before the step.

A NaN loss on one rank reaches every rank's weights through the gradient
reduction in the same step, so the check runs after backward and before
`optimizer.step()`, and all ranks agree on it with one all-reduce: each
rank raises the same error, naming the iteration and the ranks, and no
checkpoint of the poisoned state can be written after it.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..utils import non_finite_ranks


class NonFiniteError(RuntimeError):
    """A NaN or inf loss or gradient was found (with the check on)."""


def check_for_nan_in_loss_and_grad(iteration: int, loss: torch.Tensor,
                                   grads: Optional[Iterable[torch.Tensor]] = None) -> None:
    """Raise NonFiniteError on every rank when any rank's loss or gradient is NaN/inf.
    Pass `grads=None` where overflowing gradients are expected (fp16 loss
    scaling skips those steps itself)."""
    bad_loss, bad_grad = non_finite_ranks(loss, grads)
    if bad_loss or bad_grad:
        parts = []
        if bad_loss:
            parts.append(f"NaN/inf loss on rank(s) {bad_loss}")
        if bad_grad:
            parts.append(f"NaN/inf gradient on rank(s) {bad_grad}")
        raise NonFiniteError(
            f"iteration {iteration}: {' and '.join(parts)}; stopping before the optimizer step, so no "
            "checkpoint of this state is written (--no-check-for-nan-in-loss-and-grad trains on)")
