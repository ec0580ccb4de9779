"""The sharded save/load of model, optimizer and fp32 main params with
torch.distributed.checkpoint: each rank writes its own shards, and loading
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..utils import is_distributed, unwrap_model
from . import strided, vocab_padding
from .checksums import ChecksumFileSystemWriter
from .core import EXTRA_STATE_SUFFIX, CheckpointError, describe, this_process_alone
from .safe_unpickle import SafeFileSystemReader, SafeLoadPlanner, open_checkpoint


def _inner_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def _optimizer_owner(inner: nn.Module, optimizer) -> nn.Module:
    # With fp32 main params the optimizer steps those, not the model's
    # parameters: DCP names its state through a mirror holding them.
    return optimizer.main_params_module(inner) if hasattr(optimizer, "main_params_module") else inner


def sharded_state(model: nn.Module, optimizer=None, main_params: bool = True) -> dict:
    """{"model", "optimizer", "main_params"}: DTensor shards, as DCP saves and loads them."""
    inner = unwrap_model(model)
    state = {"model": get_model_state_dict(inner)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(_optimizer_owner(inner, optimizer),
                                                      _inner_optimizer(optimizer))
        if main_params and getattr(optimizer, "has_main_params", False):
            state["main_params"] = optimizer.main_params_state_dict(inner)
    return state


def save_sharded(state: dict, path: str, checksums: Optional[dict], model: Optional[nn.Module] = None) -> None:
    """Every rank writes its shards into `path`; the crc32 of each file this
    rank wrote goes into `checksums` (None: no checksums). The tensors of
    `model`'s partition-strided parameters are written in their full layout
    (strided.py). A failure on any rank raises DCP's CheckpointException on every rank."""
    planner = strided.StridedSavePlanner(strided.strided_keys(unwrap_model(model), state) if model else {})
    alone = not is_distributed()  # one process without a group: DCP's no_dist, said nothing about
    with this_process_alone() if alone else contextlib.nullcontext():
        if checksums is None:
            dcp.save(state, checkpoint_id=path, planner=planner, no_dist=alone)
        else:
            dcp.save(state, storage_writer=ChecksumFileSystemWriter(path, checksums), planner=planner, no_dist=alone)


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
    """The state to load into, the tensors to read partially (vocabulary rows
    across padding) and what this run keeps of its own instead of reading it;
    raises CheckpointError when the checkpoint does not fit."""
    state = sharded_state(model, optimizer, main_params=any(k.startswith("main_params.") for k in saved))
    kept = {}
    # Module extra state (fp8 scaling histories) that the checkpoint lacks (saved
    # without it, or before it was module state) is not read: the module keeps its own.
    for key in [k for k in state["model"] if k.endswith(EXTRA_STATE_SUFFIX) and f"model.{k}" not in saved]:
        del state["model"][key]
    if "optimizer" in state:
        saved_groups = {k.split(".")[2] for k in saved if k.startswith("optimizer.param_groups.")}
        if len(saved_groups) != len(state["optimizer"]["param_groups"]):
            # Grouped otherwise (a replicated model saved before it was wrapped kept its plain
            # and DTensor parameters in groups of their own): the per-parameter state loads by
            # name, the groups and their settings are this run's (the scheduler restores lr and wd).
            kept["param_groups"] = state["optimizer"].pop("param_groups")
    rows = vocab_padding.plan_rows(path, saved, state, vocab_padding.vocab_param_names(unwrap_model(model)),
                                   saved_vocab, true_vocab_size)
    return state, rows, kept


def _extra_state_keys(model: nn.Module) -> list[str]:
    return [f"{name}.{EXTRA_STATE_SUFFIX}".lstrip(".") for name, m in model.named_modules()
            if type(m).get_extra_state is not nn.Module.get_extra_state]


def load_sharded(path: str, model: nn.Module, optimizer, state: dict, rows: dict,
                 kept: Optional[dict] = None, legacy_interleaved: bool = False) -> int:
    """Read the shards into `state` (collective), then into the model and
    optimizer, with what prepare_load `kept` of this run's own.
    `legacy_interleaved`: the checkpoint (format 3 or before) stored a gated
    fc1 with interleaved gate and up rows (strided.py). Returns how many
    tensors were converted from that layout."""
    kept = kept or {}
    inner = unwrap_model(model)
    if rows:
        vocab_padding.zero_fill(state, vocab_padding.vocab_param_names(inner), rows)
    strided_keys = strided.strided_keys(inner, state)
    planner = _LoadPlanner(rows, strided_keys, legacy_interleaved)
    try:
        alone = not is_distributed()
        with this_process_alone() if alone else contextlib.nullcontext():
            dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=planner, no_dist=alone)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {describe(exc)}") from exc
    planner.strided_reads.finish()
    for key in _extra_state_keys(inner):
        if key not in state["model"]:  # not in the checkpoint (prepare_load): the module keeps its own
            state["model"][key] = inner.get_submodule(key[:-len(EXTRA_STATE_SUFFIX) - 1]).get_extra_state()
    set_model_state_dict(inner, state["model"], options=StateDictOptions(strict=True))
    if optimizer is not None and "main_params" not in state and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    if "optimizer" in state:
        if "param_groups" in kept:
            state["optimizer"]["param_groups"] = kept["param_groups"]
        set_optimizer_state_dict(_optimizer_owner(inner, optimizer), _inner_optimizer(optimizer),
                                 state["optimizer"])
    return len(strided_keys) if legacy_interleaved else 0
