"""The sharded load of model, optimizer and fp32 main params with
torch.distributed.checkpoint (a save is the checkpoint manager's): loading
reads whatever shards the current layout needs (TP=2 x DP=2 saved, TP=1,
TP=4 or one process loaded), across vocabulary padding too."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.planner import LoadPlan

from ..utils import is_distributed, unwrap_model
from . import strided, vocab_padding
from .core import CheckpointError, describe, this_process_alone
from .safe_unpickle import SafeFileSystemReader, SafeLoadPlanner, open_checkpoint
from .states import MainParamsState, ModelState, OptimizerState


def sharded_state(model: nn.Module, optimizer=None, main_params: bool = True) -> dict:
    """{"model", "optimizer", "main_params"}: DTensor shards, as DCP saves and loads them."""
    return {name: state.state_dict() for name, state in tensor_states(model, optimizer, main_params).items()}


def tensor_states(model: nn.Module, optimizer=None, main_params: bool = True) -> dict:
    """The Stateful tensor entries of a checkpoint of `model` and `optimizer` (states.py)."""
    found = {"model": ModelState(model)}
    if optimizer is not None:
        found["optimizer"] = OptimizerState(model, optimizer)
        if main_params and getattr(optimizer, "has_main_params", False):
            found["main_params"] = MainParamsState(model, optimizer)
    return found


class _LoadPlanner(SafeLoadPlanner):
    """DCP's load planner, with the two reads of our own: the vocabulary rows below the
    true vocabulary (vocab_padding) and partition-strided tensors (strided)."""

    def __init__(self, rows: dict[str, int], strided_keys: dict[str, int], legacy_interleaved: bool):
        super().__init__()
        self._rows, self._strided, self._legacy = rows, strided_keys, legacy_interleaved
        self.strided_reads = None

    def create_local_plan(self) -> LoadPlan:
        regular = {k: v for k, v in self.state_dict.items() if k not in self._rows and k not in self._strided}
        self.strided_reads = strided.StridedReads(self.state_dict, self._strided, self._legacy)
        items = (create_default_local_load_plan(regular, self.metadata, True).items
                 + vocab_padding.partial_row_reads(self.state_dict, self._rows, self.metadata)
                 + self.strided_reads.items(self.metadata))
        return LoadPlan(items)

    def lookup_tensor(self, index):
        found = self.strided_reads.lookup(index)
        return found if found is not None else super().lookup_tensor(index)


def read_entries(path: str, names: list[str]) -> dict:
    """{name: bytes} of the checkpoint's non-tensor entries `names` (entries.py), read by this
    rank alone (no collective): only their bytes, not a tensor."""
    if not names:
        return {}
    values = {name: b"" for name in names}
    try:
        with this_process_alone():
            dcp.load(values, storage_reader=open_checkpoint(path), no_dist=True, planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: cannot read "
                              f"{', '.join(names)} ({describe(exc)})") from exc
    return values


def read_metadata(path: str) -> dict:
    try:
        return SafeFileSystemReader(path).read_metadata().state_dict_metadata
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: cannot read its "
                              f"metadata ({exc})") from exc


def prepare_load(path: str, model: nn.Module, optimizer, saved: dict, saved_vocab: Optional[int],
                 true_vocab_size: Optional[int]) -> tuple[dict, dict, dict]:
    """(the Stateful tensor entries to load, the tensors each reads, the tensors to read
    partially: vocabulary rows across padding); raises CheckpointError when the checkpoint
    does not fit."""
    states = tensor_states(model, optimizer, main_params=any(k.startswith("main_params.") for k in saved))
    targets = {name: state.prepare(saved) if hasattr(state, "prepare") else state.state_dict()
               for name, state in states.items()}
    rows = vocab_padding.plan_rows(path, saved, targets, vocab_padding.vocab_param_names(unwrap_model(model)),
                                   saved_vocab, true_vocab_size)
    return states, targets, rows


def load_sharded(path: str, model: nn.Module, optimizer, states: dict, targets: dict, rows: dict,
                 legacy_interleaved: bool = False) -> int:
    """Read the shards into `targets` (collective), then apply them through `states`
    (prepare_load's). `legacy_interleaved`: the checkpoint (format 3 or before) stored a
    gated fc1 with interleaved gate and up rows (strided.py). Returns how many tensors
    were converted from that layout."""
    inner = unwrap_model(model)
    if rows:
        vocab_padding.zero_fill(targets, vocab_padding.vocab_param_names(inner), rows)
    strided_keys = strided.strided_keys(inner, targets)
    planner = _LoadPlanner(rows, strided_keys, legacy_interleaved)
    try:
        alone = not is_distributed()
        with this_process_alone() if alone else contextlib.nullcontext():
            dcp.load(targets, storage_reader=SafeFileSystemReader(path), planner=planner, no_dist=alone)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {describe(exc)}") from exc
    planner.strided_reads.finish()  # NOTE: before any entry applies what was read
    for name, state in states.items():  # the model first: the optimizer's state is named by its parameters
        state.load_state_dict(targets[name])
    if optimizer is not None and "main_params" not in states and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    return len(strided_keys) if legacy_interleaved else 0
