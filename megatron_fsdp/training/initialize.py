"""Ending a distributed job cleanly (Megatron-LM's `megatron/training/initialize.py` place).

torch 2.13 + gloo: a process that destroys its process group while a peer is
still inside a collective (FSDP2's last reduce-scatter, say) aborts at exit
in about one run in five ("terminate called without an active exception",
exit code 1 after a finished run). A barrier first makes every rank idle
before any of them tears its connections down.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist

from .. import parallel_state

DEFAULT_SHUTDOWN_TIMEOUT = timedelta(minutes=5)


class ShutdownError(RuntimeError):
    """Not every rank reached the end of the job."""


def shutdown_distributed(*, failed: bool = False, timeout: timedelta = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Barrier, then destroy the model-parallel state, then the default process group.

    Every entry point calls this last (see `distributed_job`). `failed=True`
    is for a rank that is ending with an error: it skips the barrier (peers
    may be dead or stuck in a collective, so waiting for them could hang) and
    leaves the process group for the exiting process to drop, so that the
    original error is printed, not replaced by an abort in the teardown.

    A barrier that fails or does not complete within `timeout` means some
    peer never finished: `ShutdownError` names the cause, and the process
    group is left alone for the same reason.
    """
    if not (dist.is_available() and dist.is_initialized()):
        parallel_state.destroy_model_parallel()
        return
    if failed:
        parallel_state.destroy_model_parallel()
        return
    try:
        # async_op + wait(timeout): a bounded barrier on every backend
        # (monitored_barrier is gloo-only).
        dist.barrier(async_op=True).wait(timeout=timeout)
    except Exception as exc:
        parallel_state.destroy_model_parallel()
        raise ShutdownError(
            f"rank {dist.get_rank()}: not every rank reached the end of the job within "
            f"{timeout.total_seconds():.0f} s ({type(exc).__name__}: {exc}); a peer has probably failed, "
            "see its error") from exc
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


class distributed_job:
    """`with distributed_job(): ...` around everything after `init_process_group`:
    on a normal exit, `shutdown_distributed()`; on an exception, the failing
    path of it, and the exception propagates unchanged."""

    def __init__(self, timeout: timedelta = DEFAULT_SHUTDOWN_TIMEOUT):
        self.timeout = timeout

    def __enter__(self) -> "distributed_job":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        # SystemExit(0) (sys.exit() in the body) is a normal end.
        failed = exc_type is not None and not (issubclass(exc_type, SystemExit) and exc.code in (None, 0))
        if failed:
            sys.stderr.flush()
        shutdown_distributed(failed=failed, timeout=self.timeout)
        return False
