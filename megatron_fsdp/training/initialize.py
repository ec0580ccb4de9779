"""Starting and ending a distributed job (Megatron-LM's `megatron/training/initialize.py`).

Start: `initialize_distributed(args)` creates the process group (NCCL on
GPUs, gloo on CPU, --distributed-timeout-minutes), then, inside
`distributed_job()`, `initialize_megatron(args)` builds the model-parallel
groups, seeds every generator as Megatron does and sets up the
number-of-microbatches calculator.

Restart (`torchrun --max-restarts N`): each attempt's groups live on a part of
torchrun's store of their own (rendezvous.py).

End: torch 2.13 + gloo: a process that destroys its process group while a peer is
still inside a collective (FSDP2's last reduce-scatter, say) aborts at exit
in about one run in five ("terminate called without an active exception",
exit code 1 after a finished run). A barrier first makes every rank idle
before any of them tears its connections down.
"""

from __future__ import annotations

import os
import random
import sys
import time
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import _torch_compat, parallel_state, tensor_parallel
from .._process_groups import release_meshes
from ..num_microbatches_calculator import destroy_num_microbatches_calculator, init_num_microbatches_calculator
from ..utils import is_distributed
from . import flight_recorder
from .global_vars import set_args
from .rendezvous import attempt_store, uses_torchrun_agent_store

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
    if not is_distributed():
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
    store, world, rank = _torch_compat.default_store(), dist.get_world_size(), dist.get_rank()
    release_meshes()  # so that destroying the default group frees every group (threads, sockets)
    dist.destroy_process_group()
    global _SHUTDOWNS
    _SHUTDOWNS += 1
    # (Under torchrun the store is this attempt's own (attempt_store): a restarted worker group
    # meets under a prefix of its own, whatever each node's TORCHELASTIC_RESTART_COUNT says.)
    _wait_until_every_rank_destroyed(store, world, f"megatron_fsdp/shutdown/{_SHUTDOWNS}", last_to_leave=rank == 0)


_SHUTDOWNS = 0  # this process's shutdowns so far: every rank counts alike, so it names this one
_DESTROY_WAIT_S = 10.0


def _wait_until_every_rank_destroyed(store, world: int, key: str, last_to_leave: bool = False) -> None:
    """A process that exits while a peer is still inside destroy_process_group
    can abort in its interpreter's teardown ("terminate called without an
    active exception": seen with gloo after the barrier too, once in a CI run
    of some thirty torchrun jobs): meet once more on the rendezvous store, which outlives the group.
    torchrun's agent hosts that store; a job started without it (MASTER_ADDR and
    MASTER_PORT, RANK 0 hosting) loses the store when rank 0 exits, and a peer
    still asking it would print a C++ connection warning: so every rank says it
    is leaving and `last_to_leave` (rank 0) waits for all of them. Best effort:
    a store that is gone or a peer that never comes ends the wait, never the job."""
    if store is None or world < 2:
        return
    deadline = time.monotonic() + _DESTROY_WAIT_S

    def meet(name: str) -> None:
        arrived = store.add(name, 1)
        while arrived < world and time.monotonic() < deadline:
            time.sleep(0.005)
            arrived = store.add(name, 0)

    try:
        meet(key)
        if last_to_leave:
            meet(f"{key}/left")
        else:
            store.add(f"{key}/left", 1)
    except Exception:  # (the store's server went away with its process: nothing left to wait for)
        return


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


def gpu_shortage(backend: str, local_world_size: int, local_rank: int) -> Optional[str]:
    """Why this node cannot give each of its processes a GPU of its own, or None.

    NCCL needs one GPU per process; with more processes than GPUs it fails
    deep in the first collective (or at set_device) with a traceback per rank.
    """
    if backend != "nccl":
        return None
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_world_size <= visible and local_rank < visible:
        return None
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f" (CUDA_VISIBLE_DEVICES={devices})" if devices is not None else ""
    if visible == 0:
        return (f"the nccl backend needs GPUs and none is visible{shown}: use --distributed-backend gloo to run "
                "on the CPU")
    return (f"{local_world_size} processes on this node but {visible} GPU{'s' if visible != 1 else ''} "
            f"visible{shown}; NCCL needs one GPU per process: start at most {visible} per node "
            f"(torchrun --nproc-per-node {visible}), or use --distributed-backend gloo to run on the CPU")


def check_launched_by_torchrun(store=None) -> None:
    """The example scripts run under torchrun, which starts their processes and gives each its
    RANK and WORLD_SIZE. Started by `python` alone they would fail later on a message about
    something else (the tensor-parallel size, torch's missing RANK): one line saying how to launch
    them, exit code 2, before the flags are read (`--help` aside, which needs no launcher). A
    caller with a store of its own passes it."""
    if store is not None or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return
    if any(word in ("-h", "--help") for word in sys.argv[1:]):
        return  # argparse prints the flags and exits
    script = sys.argv[0] or "examples/pretrain_gpt.py"
    print(f"{os.path.basename(script)}: error: RANK and WORLD_SIZE are not set: start this script with torchrun, "
          f"e.g. `torchrun --nproc-per-node N {script} <flags>` for N processes on this machine (1 or more; "
          "one per GPU)", file=sys.stderr, flush=True)
    sys.exit(2)


def initialize_distributed(args, store=None) -> None:
    """The default process group, from torchrun's environment. More processes
    on this node than visible GPUs (NCCL) is a usage error, before any
    communication: one line (the node's first process prints it), exit code 2.
    Under torchrun, on this attempt's own part of the agent's store (`attempt_store`),
    so that a restarted attempt (`--max-restarts`) forms its groups afresh."""
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    problem = gpu_shortage(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), local_rank)
    if problem:
        if local_rank == 0:
            print(f"{os.path.basename(sys.argv[0])}: error: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    flight_recorder.configure(args, backend)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    else:
        # Worker processes on one machine share its cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if store is not None:
        kwargs = {"store": store, "rank": args.rank, "world_size": args.world_size}
    elif uses_torchrun_agent_store():
        store, rank, world_size = attempt_store(timeout)
        kwargs = {"store": store, "rank": rank, "world_size": world_size}
    else:
        kwargs = {}
    dist.init_process_group(backend, timeout=timeout, **kwargs)


def set_random_seed(seed: int) -> None:
    """Python, numpy and torch generators, and the tensor-parallel RNG tracker (Megatron's offsets)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def initialize_megatron(args) -> None:
    """Model-parallel groups, seeds, microbatch calculator and the global args."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        # The wrapper's (training/configs.py): the flag's value, or every rank one when replicated.
        num_distributed_optimizer_instances=args.configs.ddp.num_distributed_optimizer_instances)
    set_random_seed(args.seed)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(dist.get_rank(), args.rampup_batch_size, args.global_batch_size,
                                     args.micro_batch_size, parallel_state.get_data_parallel_world_size(),
                                     args.decrease_batch_size_if_needed)
    set_args(args)
