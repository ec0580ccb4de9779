"""The storage layer of a save: DCP's FileSystemWriter, which checksums every
file it writes and publishes the checkpoint when DCP finishes it.

A save is then one `dcp.save` (or `dcp.async_save`) and nothing else: no
collective of our own around it, so it can run in a background thread on
its own process group while training goes on.

- Each rank's writer checksums the bytes as they are written (checksums.py)
  and returns each file's entry as one more `WriteResult` of its
  `write_data`: DCP gathers every rank's results on the coordinator for
  `finish()`, which is where the manifest is written, so the checksums
  travel with DCP's own gather.
- The coordinator's `finish()` then writes DCP's `.metadata`, the manifest,
  and runs `publish` (the rename of the temporary directory and the tracker,
  dist_checkpointing.publish). It runs only once every rank's writes
  returned, and its failure reaches every rank as DCP's CheckpointException:
  publishing is decided collectively, by DCP.
- `before_writes` runs on the coordinator after planning and before any
  rank writes (the removal of what crashed saves of earlier runs left).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .checksums import ChecksumFileSystem, write_manifest

# The fqn of a WriteResult that carries a file's checksum entry, not a tensor's location.
_CHECKSUM_FQN = "__megatron_fsdp_checksum__/"


class CheckpointWriter(FileSystemWriter):
    """DCP's FileSystemWriter into `path` (a temporary directory) with the
    checkpoint's integrity and publish in its own steps (see the module's
    docstring). `record_checksums=False` writes no manifest (measurements)."""

    def __init__(self, path: str, *, record_checksums: bool = True,
                 before_writes: Optional[Callable[[], None]] = None,
                 publish: Optional[Callable[[], None]] = None, **kwargs):
        super().__init__(path, **kwargs)
        self._record: Optional[dict] = {} if record_checksums else None
        if record_checksums:
            self.fs = ChecksumFileSystem(str(Path(path)), self._record)
        self._before_writes, self._publish = before_writes, publish

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        plans = super().prepare_global_plan(plans)
        if self._before_writes is not None:
            self._before_writes()  # NOTE: the coordinator, after every rank planned and before any writes
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        results = super().write_data(plan, planner).wait()  # the writes are done when it returns
        if self._record is not None:
            results = results + [WriteResult(index=MetadataIndex(_CHECKSUM_FQN + name), size_in_bytes=entry["size"],
                                             storage_data=entry) for name, entry in sorted(self._record.items())]
        done: Future = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        per_rank = [{r.index.fqn[len(_CHECKSUM_FQN):]: r.storage_data for r in rank_results
                     if r.index.fqn.startswith(_CHECKSUM_FQN)} for rank_results in results]
        tensors = [[r for r in rank_results if not r.index.fqn.startswith(_CHECKSUM_FQN)] for rank_results in results]
        if self._record is not None:
            self._record.clear()  # the coordinator's own files so far: already in per_rank
        super().finish(metadata, tensors)  # .metadata: checksummed by this rank's file system
        if self._record is not None:
            per_rank[0] = {**per_rank[0], **self._record}  # NOTE: the coordinator is the group's rank 0
            write_manifest(str(self.path), per_rank)
        if self._publish is not None:
            self._publish()

