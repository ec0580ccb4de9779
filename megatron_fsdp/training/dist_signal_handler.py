"""Preemption: a signal received by any rank ends the job on every rank, after a checkpoint.

Schedulers (SLURM, Kubernetes) send SIGTERM to some or all processes and kill
them a little later. The handler only records the signal; the training loop
asks `signals_received()` once per iteration, a collective, so every rank
decides to stop at the same iteration, saves and exits 0.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from .. import parallel_state
from ..utils import is_distributed


class DistributedSignalHandler:
    """Megatron-LM's `--exit-signal-handler`: `with DistributedSignalHandler(): ...`."""

    def __init__(self, sig: int = signal.SIGTERM):
        self.sig = sig
        self._received = False
        self._previous = None

    def __enter__(self) -> "DistributedSignalHandler":
        self._received = False
        self._previous = signal.getsignal(self.sig)
        signal.signal(self.sig, self._record)
        return self

    def __exit__(self, *exc) -> bool:
        signal.signal(self.sig, self._previous)
        return False

    def _record(self, signum, frame) -> None:
        self._received = True

    def signals_received(self) -> list[bool]:
        """Whether each rank has received the signal (one all-gather)."""
        flag = torch.tensor([int(self._received)], dtype=torch.int32, device=parallel_state.get_device_or_cpu())
        if not is_distributed():
            return [bool(flag.item())]
        flags = [torch.zeros_like(flag) for _ in range(dist.get_world_size())]
        dist.all_gather(flags, flag)
        return [bool(f.item()) for f in flags]
