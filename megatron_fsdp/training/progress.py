"""Which rank is stuck where, for `--distributed-timeout-minutes`.

A collective that times out says only that it waited; the ranks it waited
for are the question. Each rank records what it is doing in the job's
key-value store (the rendezvous store, which answers while ranks are stuck)
at each phase of an iteration; on a timeout the survivors read everyone's
record and name the ranks that are somewhere else.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from .. import _torch_compat
from ..utils import is_distributed

_PREFIX = "megatron_fsdp/progress/"


class CollectiveTimeoutError(RuntimeError):
    """A collective timed out; the message says during what, and where the other ranks were."""


def _store():
    # Without the store there is no explanation; nothing else breaks.
    return _torch_compat.default_store()


class ProgressBeacon:
    def __init__(self):
        self._store = _store() if is_distributed() else None
        self.phase = "start-up"

    def mark(self, phase: str) -> None:
        self.phase = phase
        if self._store is not None:
            self._store.set(f"{_PREFIX}{dist.get_rank()}", phase)

    def others(self) -> dict[int, Optional[str]]:
        """Every rank's last recorded phase (None: never recorded)."""
        if self._store is None:
            return {}
        phases = {}
        for rank in range(dist.get_world_size()):
            key = f"{_PREFIX}{rank}"
            phases[rank] = self._store.get(key).decode() if self._store.check([key]) else None
        return phases

    def explain_timeout(self, exc: BaseException) -> str:
        phases = self.others()
        elsewhere = {r: p for r, p in phases.items() if p != self.phase}
        if not phases:
            where = "the other ranks' progress is unknown"
        elif elsewhere:
            where = "ranks elsewhere: " + "; ".join(f"rank {r} at {p or 'start-up'!r}" for r, p in elsewhere.items())
        else:
            where = "every rank recorded the same phase (a rank may have died inside it)"
        return (f"rank {dist.get_rank()}: a collective timed out during {self.phase!r} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); {where}")


def is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)
