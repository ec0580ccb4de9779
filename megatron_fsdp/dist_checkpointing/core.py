"""The error every checkpoint failure raises, the one verdict every rank
raises alike (the collectives themselves are megatron_fsdp.utils'), and DCP
run by one process alone."""

from __future__ import annotations

import contextlib
import warnings
from typing import Optional

from torch.distributed.checkpoint.api import CheckpointException

from ..utils import all_gather_objects


# The state-dict key of a module's extra state (nn.Module.get_extra_state), after the module's prefix.
EXTRA_STATE_SUFFIX = "_extra_state"


@contextlib.contextmanager
def this_process_alone():
    """Around DCP called with no_dist=True (a rank reading its own entries, a conversion in one
    process): DCP warns at every call that it assumes one process, which is the intent here, and
    a resume printed it twice on every rank."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        yield


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model."""


def one_line(text: str, limit: int = 300) -> str:
    """`text` as one printable line of at most about `limit` characters: a message quoting a
    damaged file's bytes (a parser's error) must not break the one-line error."""
    text = "".join(c if c.isprintable() else "?" for c in " ".join(str(text).split()))
    return text if len(text) <= limit else text[:limit] + "..."


def describe(exc: BaseException) -> str:
    """One line per failing rank: DCP's own message is whole tracebacks."""
    if not isinstance(exc, CheckpointException):
        return one_line(f"{type(exc).__name__}: {exc}")
    lines = []
    for r, failure in sorted(exc.failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        lines.append(one_line(f"rank {r}: {type(cause).__name__}: {cause}"))
    return "; ".join(lines) or "DCP reported a failure without details"


def raise_if_any_failed(error: Optional[BaseException], what: str) -> None:
    """Agree on one verdict: when any rank failed, every rank raises a
    CheckpointError naming each failing rank and its reason, so a failure on
    rank 3 is not a bare "failed on another rank" in rank 0's log."""
    message = None
    if error is not None:
        message = str(error) if isinstance(error, CheckpointError) else describe(error)
    messages = all_gather_objects(message)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if len(failed) == len(messages) and len(set(m for _, m in failed)) == 1:
        detail = failed[0][1]  # every rank saw the same problem: say it once
    else:
        # DCP's failures are already one "rank N: ..." line each, the same on every rank.
        detail = "; ".join(dict.fromkeys(m if m.startswith("rank ") else f"rank {r}: {m}" for r, m in failed))
    raise CheckpointError(f"{what}: {detail}") from error
