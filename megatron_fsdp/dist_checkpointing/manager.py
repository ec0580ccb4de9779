"""The one owner of a run's checkpoint saves: `CheckpointManager`.

A save is one DCP call on the manager's own gloo group (made once), with the
states as `Stateful` entries (states.py) and integrity and publish in the
storage layer (writer.py): the training loop's default group sees nothing of it.

Synchronous (`async_save=False`): `save` returns once the checkpoint is
published, or raises CheckpointError on every rank with the previous
checkpoint kept. Asynchronous (Megatron's --async-save): `save` stages the
state (a copy into CPU memory, pinned where CUDA is present) before it
returns, so the next optimizer step cannot change what is written, and
DCP's `async_save` writes it from a background thread. Published only when
every rank's write finished (writer.py: the coordinator's finish), the
tracker last. `finalize()` asks every rank (one all-reduce on the manager's
second group) whether the pending save is done; once it is, the ranks agree
on its outcome (one gather of their verdicts) and report it alike: the
published checkpoint, or the same CheckpointError everywhere. The next save
and every exit wait for it first.

Why a thread, not DCP's process-based checkpointer: the write itself (file
I/O and the CRC-32C of the extension) releases the GIL, the staged copy is
handed over without a second copy into shared memory, and a kill -9 of a
rank takes its writer with it, so no orphan writer can publish after a
crash or outlive a restarted job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from .. import _torch_compat
from ..utils import get_rank_safe, is_distributed
from . import publish, strided
from .core import CheckpointError, describe, this_process_alone
from .writer import CheckpointWriter

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SavedCheckpoint:
    """A published checkpoint, as the log reports it."""
    iteration: int
    path: str
    blocking_s: float  # the training loop's stall: planning and (async) staging, or (sync) the whole save
    write_s: Optional[float] = None  # async: the background write, from the end of staging to the publish

    def describe(self) -> str:
        if self.write_s is None:
            return f"saved checkpoint at iteration {self.iteration} to {self.path} (blocking {self.blocking_s:.2f} s)"
        return (f"saved checkpoint at iteration {self.iteration} to {self.path} (blocking {self.blocking_s:.2f} s, "
                f"background write {self.write_s:.2f} s)")


@dataclasses.dataclass
class _Pending:
    future: Future
    saved: SavedCheckpoint
    tmp: str
    written_at: float  # when staging ended
    finished_at: Optional[float] = None  # when this rank's save returned (its background thread)


class _SavePlanner(strided.StridedSavePlanner):
    """DCP's save planner for partition-strided tensors (strided.py) that raises, inside DCP's
    planning collective, what went wrong on this rank before the save: every rank then gets it."""

    def __init__(self, strided_keys: dict, error: Optional[BaseException] = None):
        super().__init__(strided_keys)
        self._error = error

    def create_local_plan(self):
        if self._error is not None:
            raise self._error  # NOTE: DCP gathers it: every rank raises, none waits for this one
        return super().create_local_plan()


class _AlreadyStaged:
    """An AsyncStager for a state the manager staged itself (DCP's protocol)."""
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _interruption(exc: BaseException) -> Optional[BaseException]:
    """The interruption (a BaseException that is no Exception) DCP wrapped into its
    CheckpointException on this rank, if that is what ended the save."""
    if not isinstance(exc, CheckpointException):
        return None
    for failure in exc.failures.values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, BaseException) and not isinstance(cause, Exception):
            return cause
    return None


def to_plain(states: dict) -> dict:
    """DCP's view of `states`: each Stateful entry's state_dict()."""
    return {name: value.state_dict() if isinstance(value, Stateful) else value for name, value in states.items()}


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in `state` (this rank's shards of DTensors)."""
    return sum(_torch_compat.local_tensor(t).nbytes for t in _torch_compat.tree_leaves(state)
               if isinstance(t, torch.Tensor))


class CheckpointManager:
    """Saves a run's checkpoints (see the module's docstring). Every rank makes one, in the
    same order as its other process groups, and calls `save` alike. `timeout` bounds the
    save's collectives, a background write's included (None: the default group's)."""

    def __init__(self, *, async_save: bool = False, timeout: Optional[timedelta] = None):
        self.async_save = async_save
        self.last_staged_bytes = 0
        self.last_saved: Optional[SavedCheckpoint] = None  # the latest published by this manager
        self._timeout = timeout
        self._world = None  # the default group the groups below belong to
        self._save_group: Optional[dist.ProcessGroup] = None  # DCP's collectives
        self._control_group: Optional[dist.ProcessGroup] = None  # "is the background save done?"
        self._run_id: Optional[str] = None
        self._saves = 0
        self._pending: Optional[_Pending] = None
        self._stager: Optional[DefaultStager] = None

    # ------------------------------------------------------------------ set-up

    def setup(self) -> None:
        """Make the manager's process groups (a collective on every rank; once, at the first
        save otherwise) and agree on the run's name for temporary directories."""
        if not is_distributed():
            return
        if self._world is dist.group.WORLD:
            return
        timeout = self._timeout or _torch_compat.group_timeout(dist.group.WORLD)
        self._save_group = dist.new_group(backend="gloo", timeout=timeout)
        self._control_group = dist.new_group(backend="gloo", timeout=timeout)
        box = [publish.run_id()]
        dist.broadcast_object_list(box, src=0, group=self._control_group)
        self._run_id, self._world = box[0], dist.group.WORLD

    @property
    def run_id(self) -> str:
        """Names this run's temporary directories; rank 0's, the same on every rank."""
        return self._run_id if is_distributed() else publish.run_id()

    # ------------------------------------------------------------------ save

    def save(self, iteration: int, states: dict, save_dir: str, *, strided_model=None,
             record_checksums: bool = True, async_save: Optional[bool] = None) -> Optional[SavedCheckpoint]:
        """Write `states` ({name: Stateful or value}) as checkpoint `iteration` of `save_dir`.
        Waits for a pending save first. Synchronous: returns the published checkpoint.
        Asynchronous: returns None once staged (finalize reports the publish).
        `strided_model`: the model whose partition-strided tensors are written in their
        full layout (strided.py). A failure raises CheckpointError on every rank."""
        self.finalize(blocking=True)
        self.setup()
        async_save = self.async_save if async_save is None else async_save
        final = publish.checkpoint_dir(save_dir, iteration)
        tmp = publish.temp_dir_for(final, self.run_id, self._saves)
        self._saves += 1
        started = time.perf_counter()
        error, plain = None, {}
        try:
            plain = to_plain(states)
            keys = strided.strided_keys(strided_model, plain) if strided_model is not None else {}
            if async_save:
                plain = self._stage(plain)
        except Exception as exc:  # raised in DCP's planning instead (_SavePlanner)
            error, keys = exc, {}
        writer = CheckpointWriter(
            tmp, record_checksums=record_checksums,
            before_writes=lambda: publish.clean_stale(save_dir, publish.is_complete, self.run_id),
            publish=lambda: publish.publish(tmp, final, then=lambda: publish.write_tracker(save_dir, iteration)))
        saved = SavedCheckpoint(iteration, final, 0.0)
        if not async_save:
            self._run(lambda: dcp.save(plain, storage_writer=writer, planner=_SavePlanner(keys, error),
                                       **self._dcp_group()), final, tmp)
            saved.blocking_s = time.perf_counter() - started
            self.last_saved = saved
            return saved
        started_save = []  # what async_save raises at once is one line too (_run)
        self._run(lambda: started_save.append(dcp.async_save(
            plain, storage_writer=writer, planner=_SavePlanner(keys, error), async_stager=_AlreadyStaged(),
            **self._dcp_group())), final, tmp)
        future = started_save[0]
        saved.blocking_s = time.perf_counter() - started
        pending = self._pending = _Pending(future, saved, tmp, written_at=time.perf_counter())
        future.add_done_callback(lambda _: setattr(pending, "finished_at", time.perf_counter()))
        return None

    def _dcp_group(self) -> dict:
        if not is_distributed():
            return {"no_dist": True}
        return {"process_group": self._save_group}

    def _stage(self, plain: dict) -> dict:
        """A copy of `plain`'s tensors in CPU memory (pinned, reused from save to save, with CUDA)."""
        if self._stager is None:
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        staged = self._stager.stage(plain)
        self._stager.synchronize_staging()  # NOTE: the copy is complete before the next step changes the source
        self.last_staged_bytes = tensor_bytes(staged)
        return staged

    def _run(self, save, final: str, tmp: str) -> None:
        """`save()`, with its failure as one CheckpointError (the same on every rank: DCP
        gathered it) and the temporary directory removed."""
        try:
            with this_process_alone() if not is_distributed() else contextlib.nullcontext():
                save()
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            interrupt = _interruption(exc)
            if interrupt is not None:
                raise interrupt  # KeyboardInterrupt, SystemExit: not a failed save, and not ours to tidy
            self._discard(tmp)
            raise CheckpointError(f"saving checkpoint {final} failed, the previous checkpoint is kept: "
                                  f"{describe(exc)}") from exc

    def _discard(self, tmp: str) -> None:
        # Every rank is past its writes once DCP reported the failure: rank 0 removes them.
        if get_rank_safe() == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ pending saves

    def pending_done(self) -> bool:
        """This rank's part of the pending save has ended (no collective; finalize decides)."""
        return self._pending is not None and self._pending.future.done()

    @property
    def pending(self) -> Optional[SavedCheckpoint]:
        """The asynchronous save in flight (not yet published), or None."""
        return self._pending.saved if self._pending is not None else None

    def finalize(self, blocking: bool = False) -> Optional[SavedCheckpoint]:
        """The pending asynchronous save, once every rank's is published: its SavedCheckpoint
        (on every rank alike), else None. `blocking` waits for it. Raises CheckpointError on
        every rank when it failed. A collective while a save is pending."""
        if self._pending is None:
            return None
        if not blocking and not self._all_ranks(self._pending.future.done()):
            return None
        pending, self._pending = self._pending, None
        self._agreed(lambda: self._run(pending.future.result, pending.saved.path, pending.tmp), pending.saved.path)
        pending.saved.write_s = (pending.finished_at or time.perf_counter()) - pending.written_at
        self.last_saved = pending.saved
        return pending.saved

    def wait_locally(self, timeout: Optional[float] = None) -> Optional[SavedCheckpoint]:
        """On an error's way out, where the other ranks may not join a collective: wait for this
        rank's part of the pending save (published by the coordinator when every rank's is done)."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        try:
            pending.future.result(timeout=timeout)
        except BaseException as exc:  # noqa: BLE001  (the error being raised matters more)
            logger.warning("the checkpoint save pending at iteration %d did not finish: %s",
                           pending.saved.iteration, describe(exc) if isinstance(exc, Exception) else exc)
            return None
        pending.saved.write_s = (pending.finished_at or time.perf_counter()) - pending.written_at
        self.last_saved = pending.saved
        return pending.saved

    def _agreed(self, outcome, path: str) -> None:
        """`outcome()` (which raises CheckpointError for a failed save) with one verdict for
        every rank: DCP gives every rank the failure it gathered, but a rank whose own
        collective failed (a peer gone, a timeout) knows more than the others."""
        error = None
        try:
            outcome()
        except CheckpointError as exc:
            error = str(exc)
        if is_distributed():
            verdicts = [None] * dist.get_world_size(self._control_group)
            dist.all_gather_object(verdicts, error, group=self._control_group)
        else:
            verdicts = [error]
        failed = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict is not None]
        if failed:
            if len(set(v for _, v in failed)) == 1 and len(failed) == len(verdicts):
                raise CheckpointError(failed[0][1])
            raise CheckpointError(f"saving checkpoint {path} failed on rank(s) {[r for r, _ in failed]}: "
                                  + "; ".join(dict.fromkeys(v for _, v in failed)))

    def _all_ranks(self, done: bool) -> bool:
        if not is_distributed():
            return done
        flag = torch.tensor([1 if done else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._control_group)
        return bool(flag.item())

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


_default: Optional[CheckpointManager] = None


def get_checkpoint_manager() -> CheckpointManager:
    """The process's manager (pretrain() sets one up with its flags; a synchronous one otherwise)."""
    global _default
    if _default is None:
        _default = CheckpointManager()
    return _default


def set_checkpoint_manager(manager: Optional[CheckpointManager]) -> Optional[CheckpointManager]:
    """Make `manager` the process's; returns the one it replaces."""
    global _default
    previous, _default = _default, manager
    return previous


__all__ = ["CheckpointManager", "SavedCheckpoint", "get_checkpoint_manager", "set_checkpoint_manager"]
