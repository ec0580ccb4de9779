"""A pool of gloo worker processes that runs many test cases.

Starting torch in a process takes seconds on a 2-core machine, so each world
size gets one pool for the whole pytest session, and every rank is forked from
one server process that imported torch and megatron_fsdp once (multiprocessing's
forkserver, PRELOADED): a pool starts in about the time of one import, and so
does the fresh pool that replaces a broken one. A case is a module-level
function; every rank runs it and the pool returns each rank's result, or
raises with every failing rank's traceback. A case that hangs (a rank stuck in
a collective) times out, the pool is torn down, and the next case gets a
fresh one. Pools end by killing their ranks: between cases a rank holds nothing
to save.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta


# The pool's own group's timeout: a case whose peer raised fails in this time, not in the case's
# timeout (helpers.setup_parallel gives a case's model-parallel groups the same).
GROUP_TIMEOUT = timedelta(seconds=30)

# Threads in a rank (it idles at about 30) above which the pool renews its ranks' process group
# after a case, and above which, even then, the case has left something alive (_check_threads).
_MAX_THREADS = 120


@dataclass
class RankError:
    rank: int
    type_name: str
    message: str
    traceback: str


class CaseFailed(AssertionError):
    def __init__(self, name: str, errors: list[RankError]):
        self.errors = errors
        details = "\n".join(f"--- rank {e.rank}: {e.type_name}: {e.message}\n{e.traceback}" for e in errors)
        super().__init__(f"case {name} failed on ranks {[e.rank for e in errors]}\n{details}")


class CaseTimedOut(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, tasks, results, sys_path: list[str],
                 environ: dict[str, str]) -> None:
    sys.path[:] = sys_path
    # The environment of the moment the pool starts, as a spawned process would get it (the fork
    # server's own is that of the first pool's start).
    os.environ.clear()
    os.environ.update(environ)
    # A spawned process inherits "spawn" as its default start method; a process torchrun starts
    # has Linux's "fork", which is what a job's data loader workers get there (spawning them
    # pickles the dataset's index arrays into each: seconds per worker).
    mp.set_start_method("fork", force=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    # Before any process group, as in a script (FSDP2 imports it): its functions take the
    # default group of the moment they are imported as a default argument, so a first import
    # inside a case would keep that case's own group (a pretrain() job's) alive in the rank.
    import torch.distributed.nn  # noqa: F401

    torch.set_num_threads(1)
    init_pool_group(rank, world_size)
    from async_save_mode import install_if_asked

    install_if_asked()  # the checkpoint tests' asynchronous mode, when CI's step asks for it
    _freeze_survivors()
    while True:  # until the pool ends the process (WorkerPool.close)
        module_name, func_name, args, kwargs = tasks.get()
        try:
            func = getattr(importlib.import_module(module_name), func_name)
            outcome = ("ok", func(*args, **kwargs))
        except BaseException as exc:  # report everything, including assertion failures
            outcome = ("error", RankError(rank, type(exc).__name__, str(exc), traceback.format_exc()))
        finally:
            _reset_globals()
            _freeze_survivors()
        results.put((rank, outcome))


def init_pool_group(rank: int, world_size: int) -> None:
    """The pool's own default group of a rank, on the port MASTER_PORT names."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)


def agree_on_free_ports(count: int) -> list[int]:
    """`count` free ports, picked by rank 0 and told to every rank of the default group."""
    import torch.distributed as dist

    ports = [_free_port() for _ in range(count)] if dist.get_rank() == 0 else [None] * count
    dist.broadcast_object_list(ports, src=0)
    return ports


def thread_count(pid="self") -> int:
    """Threads of a process (Linux's /proc)."""
    return len(os.listdir(f"/proc/{pid}/task"))


def _renew_process_group() -> None:
    """A pool task: end this rank's process group, every group made in it with it, and start a
    new one on a new port. The groups of a layout live as long as the default group (meshes are
    cached per layout, as Megatron keeps its groups after destroy_model_parallel), so cases that
    try many layouts pile up gloo's threads (a few per group per rank), which wake now and then."""
    import torch.distributed as dist
    from megatron_fsdp.training.initialize import shutdown_distributed

    rank, world_size = dist.get_rank(), dist.get_world_size()
    (port,) = agree_on_free_ports(1)
    shutdown_distributed()  # what a job does last: the meshes let go, then the default group
    os.environ["MASTER_PORT"] = str(port)
    init_pool_group(rank, world_size)


def _freeze_survivors() -> None:
    """Move what outlived the case (torch's and megatron_fsdp's modules, caches) out of the cyclic
    collector's reach: later collections then walk a case's own objects, not the millions that
    importing torch created (a few percent of a case's CPU time otherwise)."""
    gc.collect()
    gc.freeze()


def _reset_globals() -> None:
    """What one case leaves behind must not reach the next: the model-parallel state (and the
    RNG tracker with it), pretrain()'s args, tokenizer and microbatch calculator, and the
    process-wide FSDP copy kernels (only if a case loaded their adapter)."""
    from megatron_fsdp import parallel_state
    from megatron_fsdp.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron_fsdp.training.global_vars import destroy_global_vars

    parallel_state.destroy_model_parallel()
    destroy_global_vars()
    destroy_num_microbatches_calculator()
    copy_ops = sys.modules.get("megatron_fsdp.kernels.fsdp_copy_ops")
    if copy_ops is not None:
        copy_ops.disable_fsdp_copy_kernels()


# What the fork server imports before it forks any rank: what every rank would import first.
# NOTE: nothing here may start a thread or an OpenMP pool (a forked child gets no copy of them);
# each rank sets its own thread count after the fork.
PRELOADED = ["torch", "torch.distributed.nn", "torch.distributed.checkpoint", "torch._dynamo",
             "megatron_fsdp.training.training", "megatron_fsdp.models.gpt", "helpers", "pretrain_in_pool"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)  # read when the server starts: with the first pool
    return ctx


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = _context()
        port = _free_port()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            # Not daemonic: a case may start processes of its own (a pretrain() job's data loader
            # workers); close() ends the ranks, at the latest when this process exits.
            ctx.Process(target=_worker_main, daemon=False,
                        args=(rank, world_size, port, self._tasks[rank], self._results, list(sys.path),
                              dict(os.environ)))
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False
        atexit.register(self.close)

    def run(self, func, *args, timeout: float = 180.0, **kwargs) -> list:
        """Run `func(*args, **kwargs)` on every rank; return the results by rank."""
        outcomes = self._run(func, args, kwargs, timeout)
        errors = [o[1] for o in outcomes if o[0] == "error"]
        if errors:
            raise CaseFailed(func.__name__, errors)
        return [o[1] for o in outcomes]

    def run_expecting_errors(self, func, *args, timeout: float = 180.0, **kwargs) -> list[RankError]:
        """Run a case that must fail on every rank; return each rank's error."""
        outcomes = self._run(func, args, kwargs, timeout)
        passed = [rank for rank, o in enumerate(outcomes) if o[0] == "ok"]
        if passed:
            raise AssertionError(f"case {func.__name__} did not raise on ranks {passed}")
        return [o[1] for o in outcomes]

    def _run(self, func, args, kwargs, timeout):
        if self.broken:
            raise RuntimeError("worker pool is broken")
        outcomes = self._run_task((func.__module__, func.__name__, args, kwargs), func.__name__, timeout)
        try:
            self._check_threads(func.__name__)
        except AssertionError as exc:
            if all(o[0] == "ok" for o in outcomes):
                raise
            # A case that failed (or had to) reports its own errors; the next case gets a fresh pool.
            self.close()
            warnings.warn(f"after case {func.__name__}, which raised on some rank: {exc}")
        return outcomes

    def _run_task(self, task, name, timeout):
        for q in self._tasks:
            q.put(task)
        outcomes = [None] * self.world_size
        for _ in range(self.world_size):
            try:
                rank, outcome = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                missing = [r for r, o in enumerate(outcomes) if o is None]
                raise CaseTimedOut(f"case {name} timed out after {timeout}s; ranks {missing} "
                                   "did not finish (a hang in a collective?)")
            outcomes[rank] = outcome
        return outcomes

    def _check_threads(self, case: str) -> None:
        """After a case: ranks over _MAX_THREADS renew their process group (_renew_process_group);
        still over it, the case has left something alive, and fails by name (the next case gets a
        fresh pool). A finished pretrain() job once kept all its groups (30-60 threads per job at
        4 ranks, fixed in _process_groups.release_meshes and tested in test_parallel_state)."""
        if not self._over_thread_limit():
            return
        errors = [o[1] for o in self._run_task(("distributed_pool", "_renew_process_group", (), {}),
                                               "_renew_process_group", 60.0) if o[0] == "error"]
        if errors:
            self.close()
            raise CaseFailed(f"_renew_process_group (after {case})", errors)
        leaking = self._over_thread_limit()
        if leaking:
            self.close()
            raise AssertionError(f"case {case} left threads alive: {leaking} threads by rank after "
                                 f"it and a new process group (at most {_MAX_THREADS}); something "
                                 "of the case (a data loader? a group of its own?) outlives it")

    def _over_thread_limit(self) -> dict[int, int]:
        """{rank: threads} for the ranks above _MAX_THREADS (Linux; elsewhere nothing is counted)."""
        counts = {}
        for rank, p in enumerate(self._procs):
            try:
                counts[rank] = thread_count(p.pid)
            except OSError:
                pass
        return {rank: n for rank, n in counts.items() if n > _MAX_THREADS}

    def close(self) -> None:
        """End every rank now. Between cases a rank holds nothing that a clean exit would save
        (a graceful shutdown cost seconds at the end of each session), and a rank stuck in a
        collective would never read a request to stop."""
        self.broken = True
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.join()
