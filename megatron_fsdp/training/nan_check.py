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
import torch.distributed as dist

from .. import _torch_compat


class NonFiniteError(RuntimeError):
    """A NaN or inf loss or gradient was found (with the check on)."""


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    if not tensors:
        return True
    # The inf-norm is each tensor's max |x|: inf if any element is, NaN if any is.
    return bool(torch.stack(_torch_compat.foreach_norm(tensors, float("inf"))).isfinite().all())


def non_finite_ranks(loss: torch.Tensor, grads: Optional[Iterable[torch.Tensor]] = None,
                     group: Optional[dist.ProcessGroup] = None) -> tuple[list[int], list[int]]:
    """(ranks whose loss is not finite, ranks holding a non-finite gradient),
    the same on every rank of `group`. `grads` are this rank's local shards."""
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in (grads or ())]
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    flags = torch.zeros(2, world, device=loss.device)
    flags[0, rank] = 0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0
    flags[1, rank] = 0.0 if _all_finite([g.detach() for g in grads]) else 1.0
    if distributed:
        dist.all_reduce(flags, group=group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if distributed and group is not None else (lambda r: r)
    bad_loss, bad_grad = (flags[i].nonzero().flatten().tolist() for i in range(2))
    return [to_global(r) for r in bad_loss], [to_global(r) for r in bad_grad]


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
