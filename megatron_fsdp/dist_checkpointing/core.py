"""The error every checkpoint failure raises, and the few collectives that
make every rank see the same outcome."""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model."""


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank: one view of files that can change
    between two ranks' reads (the tracker, a manifest)."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(value: Any) -> list:
    if not is_distributed():
        return [value]
    out = [None] * world_size()
    dist.all_gather_object(out, value)
    return out


def describe(exc: BaseException) -> str:
    """One line per failing rank: DCP's own message is whole tracebacks."""
    if not isinstance(exc, CheckpointException):
        return f"{type(exc).__name__}: {exc}"
    lines = []
    for r, failure in sorted(exc.failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        lines.append(f"rank {r}: {type(cause).__name__}: {cause}")
    return "; ".join(lines) or "DCP reported a failure without details"


def raise_if_any_failed(error: Optional[BaseException], what: str) -> None:
    """Agree on one verdict: when any rank failed, every rank raises a
    CheckpointError naming each failing rank and its reason, so a failure on
    rank 3 is not a bare "failed on another rank" in rank 0's log."""
    message = None
    if error is not None:
        message = str(error) if isinstance(error, CheckpointError) else describe(error)
    messages = all_gather(message)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if len(failed) == len(messages) and len(set(m for _, m in failed)) == 1:
        detail = failed[0][1]  # every rank saw the same problem: say it once
    else:
        # DCP's failures are already one "rank N: ..." line each, the same on every rank.
        detail = "; ".join(dict.fromkeys(m if m.startswith("rank ") else f"rank {r}: {m}" for r, m in failed))
    raise CheckpointError(f"{what}: {detail}") from error


def gather_to_rank0(value: Any) -> Optional[list]:
    """Every rank's `value` on rank 0 (None elsewhere)."""
    if not is_distributed():
        return [value]
    out = [None] * world_size() if rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out
