"""The sharded save/load of model, optimizer and fp32 main params with
torch.distributed.checkpoint: each rank writes its own shards, and loading
reads whatever shards the current layout needs (TP=2 x DP=2 saved, TP=1,
TP=4 or one process loaded), across vocabulary padding too."""

from __future__ import annotations

from typing import Optional

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..utils import unwrap_model
from . import vocab_padding
from .checksums import ChecksumFileSystemWriter
from .core import EXTRA_STATE_SUFFIX, CheckpointError, describe


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


def save_sharded(state: dict, path: str, checksums: Optional[dict]) -> None:
    """Every rank writes its shards into `path`; the crc32 of each file this
    rank wrote goes into `checksums` (None: no checksums). A failure on any
    rank raises DCP's CheckpointException on every rank."""
    if checksums is None:
        dcp.save(state, checkpoint_id=path)
    else:
        dcp.save(state, storage_writer=ChecksumFileSystemWriter(path, checksums))


def read_entries(path: str, names: list[str]) -> dict:
    """{name: bytes} of the checkpoint's non-tensor entries `names` (entries.py), read by this
    rank alone (no collective): only their bytes, not a tensor."""
    if not names:
        return {}
    values = {name: b"" for name in names}
    try:
        dcp.load(values, checkpoint_id=path, no_dist=True)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: cannot read "
                              f"{', '.join(names)} ({describe(exc)})") from exc
    return values


def read_metadata(path: str) -> dict:
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
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
                 kept: Optional[dict] = None) -> None:
    """Read the shards into `state` (collective), then into the model and
    optimizer, with what prepare_load `kept` of this run's own."""
    kept = kept or {}
    if rows:
        vocab_padding.zero_fill(state, vocab_padding.vocab_param_names(unwrap_model(model)), rows)
    try:
        dcp.load(state, checkpoint_id=path, planner=vocab_padding.RowsLoadPlanner(rows))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {describe(exc)}") from exc
    inner = unwrap_model(model)
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
