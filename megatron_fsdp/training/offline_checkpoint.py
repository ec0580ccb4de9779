"""Our training checkpoints read and written by one process, tensor by tensor,
without building a model: what tools/checkpoint/convert.py streams through.

`CheckpointReader` opens a checkpoint directory (the tracker's iteration or a
given one) and reads each model tensor alone, as its full value: DCP reads
only that tensor's bytes, whatever TP x DP layout wrote it (a gated fc1 of a
format-3 checkpoint comes back as [gate; up], like every later one).

`write_checkpoint` writes a checkpoint of the current format holding model
weights only (load it with --finetune or --no-load-optim), from a spec of
names, shapes and dtypes and a function producing each tensor when DCP
writes it, so that no more than one tensor (or the few one of them is built
from) is in memory at a time. Written aside, checksummed, then published as
save_checkpoint does.
"""

from __future__ import annotations

import shutil
from typing import Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..dist_checkpointing import checksums, entries, publish, torch_dcp
from ..dist_checkpointing.writer import CheckpointWriter
from ..dist_checkpointing.lazy_save import LazySavePlanner
from ..dist_checkpointing.core import EXTRA_STATE_SUFFIX, CheckpointError, describe, this_process_alone
from ..dist_checkpointing.safe_unpickle import SafeLoadPlanner, open_checkpoint
from . import checkpointing as ckpt

_FC1 = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


class CheckpointReader:
    """One of our checkpoints, opened for reading tensor by tensor (no collective)."""

    def __init__(self, load_dir: str, iteration: Optional[int] = None, verify: bool = True):
        found = ckpt._resolve(load_dir, iteration, verify)
        if found["missing"]:
            raise CheckpointError(found["missing"])
        self.path = found["path"]
        if verify:
            checksums.verify(self.path, found["manifest"] or {})
        saved = torch_dcp.read_metadata(self.path)
        common = ckpt._read_entries(self.path, saved, ())
        if common.get("format") != ckpt.CKPT_FORMAT:
            raise CheckpointError(f"checkpoint {self.path} has format {common.get('format')!r}")
        self.iteration = common["iteration"]
        self.version = common.get("version", 2)
        self.args = dict((common.get("extra_state") or {}).get("args") or {})
        self.true_vocab_size = (common.get("vocab") or {}).get("true_vocab_size")
        self._tensors = {k[len("model."):]: md for k, md in saved.items()
                         if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
                         and not k.endswith(EXTRA_STATE_SUFFIX)}

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._tensors[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].properties.dtype

    def tensor(self, name: str) -> torch.Tensor:
        """The full value of model tensor `name` (its bytes alone are read)."""
        if name not in self._tensors:
            raise CheckpointError(f"checkpoint {self.path} has no model tensor {name}")
        out = {f"model.{name}": torch.empty(self.shape(name), dtype=self.dtype(name))}
        try:
            with this_process_alone():
                dcp.load(out, storage_reader=open_checkpoint(self.path), no_dist=True, planner=SafeLoadPlanner())
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"checkpoint {self.path}: cannot read {name} ({describe(exc)})") from exc
        tensor = out[f"model.{name}"]
        if self.version < ckpt.GATE_UP_SINCE and name.endswith(_FC1) and self._gated(name):
            tensor = torch.cat((tensor[0::2], tensor[1::2]))  # stored interleaved before format 4
        return tensor

    def _gated(self, fc1_name: str) -> bool:
        """A gated MLP's fc1 has twice the rows of fc2's columns (its gate and up rows)."""
        prefix = fc1_name.rsplit("linear_fc1.", 1)[0]
        fc1, fc2 = self._tensors.get(prefix + "linear_fc1.weight"), self._tensors.get(prefix + "linear_fc2.weight")
        return fc1 is not None and fc2 is not None and fc1.size[0] == 2 * fc2.size[-1]


def stored_model_args(load_dir: str) -> dict:
    """The model flags (destination names) stored in `load_dir`'s latest checkpoint
    (--use-checkpoint-args); raises CheckpointError when it holds none."""
    reader = CheckpointReader(load_dir, verify=False)
    stored = {name: value for name, value in reader.args.items() if value is not None}
    if not stored:
        raise CheckpointError(f"checkpoint {reader.path} stores no model flags (it was not saved by pretrain() "
                              "or tools/checkpoint/convert.py)")
    return stored


def write_checkpoint(save_dir: str, spec: dict[str, tuple[torch.Size, torch.dtype]],
                     produce: Callable[[str], torch.Tensor], *, args: dict, true_vocab_size: Optional[int],
                     source: str, iteration: int = 0) -> str:
    """Write model tensors `spec` ({name: (shape, dtype)}; `produce(name)` gives each) as a
    checkpoint of `save_dir` at `iteration`, with `args` (the architecture flags) as its
    training state's stored arguments. One process; returns the checkpoint's path."""
    final = ckpt.checkpoint_dir(save_dir, iteration)
    # No run's layout (so no RNG states to restore), and no module to ask for its vocabulary tables.
    train_state = ckpt.train_state(iteration, {"converted_from": source}, true_vocab_size, [], {"args": args})
    state = {"model": {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in spec.items()},
             ckpt._TRAIN_STATE: entries.pack(train_state)}
    with publish.output_directory(save_dir):
        publish.clean_stale(save_dir, ckpt._is_complete)
        tmp = publish.temp_dir_for(final)
        writer = CheckpointWriter(tmp, publish=lambda: publish.publish(
            tmp, final, then=lambda: publish.write_tracker(save_dir, iteration)))
        try:
            with this_process_alone():
                dcp.save(state, storage_writer=writer,
                         planner=LazySavePlanner(lambda key: produce(key[len("model."):])), no_dist=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
