"""The entries of a checkpoint, each a `Stateful` of PyTorch DCP: one dict of
them is what a save hands to `dcp.save` and a load to `dcp.load`.

    "model"                the model's tensors, DTensor shards (ModelState)
    "optimizer"            the optimizer's state and groups (OptimizerState)
    "main_params"          fp32 main params of a bf16/fp16 model (MainParamsState)
    "train_state", "opt_param_scheduler", "grad_scaler", <extra>
                           one checksummed blob each (EntryState, entries.py)
    "rng"                  {"rank_NNNNN": blob}: each rank's RNG states (RNGState)

The tensor entries give DCP the tensors to write, or to read into; a load
first adapts them to what the checkpoint holds (`prepare`: module extra
state it lacks, optimizer groups it grouped otherwise), then DCP reads in
place and `load_state_dict` applies the result. The blobs are read by each
rank alone before any tensor (the checks of load_checkpoint), so their
`load_state_dict` takes the unpacked value.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from ..tensor_parallel import random as tp_random
from ..utils import get_rank_safe, unwrap_model
from . import entries
from .core import EXTRA_STATE_SUFFIX


class HasState(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


def _inner_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def _optimizer_owner(inner: nn.Module, optimizer) -> nn.Module:
    # With fp32 main params the optimizer steps those, not the model's
    # parameters: DCP names its state through a mirror holding them.
    return optimizer.main_params_module(inner) if hasattr(optimizer, "main_params_module") else inner


def _extra_state_keys(model: nn.Module) -> list[str]:
    return [f"{name}.{EXTRA_STATE_SUFFIX}".lstrip(".") for name, m in model.named_modules()
            if type(m).get_extra_state is not nn.Module.get_extra_state]


class ModelState(Stateful):
    """The model's state dict as DTensor shards."""

    def __init__(self, model: nn.Module):
        self.module = unwrap_model(model)
        self._targets: Optional[dict] = None

    def state_dict(self) -> dict:
        return self._targets if self._targets is not None else get_model_state_dict(self.module)

    def prepare(self, saved: dict) -> dict:
        """The tensors to read from a checkpoint whose DCP metadata is `saved`: module extra
        state (fp8 scaling histories) it lacks is not read, the module keeps its own."""
        targets = get_model_state_dict(self.module)
        for key in [k for k in targets if k.endswith(EXTRA_STATE_SUFFIX) and f"model.{k}" not in saved]:
            del targets[key]
        self._targets = targets
        return targets

    def load_state_dict(self, state: dict) -> None:
        self._targets = None
        for key in _extra_state_keys(self.module):
            if key not in state:  # not in the checkpoint (prepare): the module keeps its own
                state[key] = self.module.get_submodule(key[:-len(EXTRA_STATE_SUFFIX) - 1]).get_extra_state()
        set_model_state_dict(self.module, state, options=StateDictOptions(strict=True))


class OptimizerState(Stateful):
    """The optimizer's state and parameter groups, named by the model's parameters."""

    def __init__(self, model: nn.Module, optimizer):
        self.owner = _optimizer_owner(unwrap_model(model), optimizer)
        self.optimizer = _inner_optimizer(optimizer)
        self._targets: Optional[dict] = None
        self._kept_groups = None

    def state_dict(self) -> dict:
        return self._targets if self._targets is not None else get_optimizer_state_dict(self.owner, self.optimizer)

    def prepare(self, saved: dict) -> dict:
        targets = get_optimizer_state_dict(self.owner, self.optimizer)
        saved_groups = {k.split(".")[2] for k in saved if k.startswith("optimizer.param_groups.")}
        if len(saved_groups) != len(targets["param_groups"]):
            # Grouped otherwise (a replicated model saved before it was wrapped kept its plain
            # and DTensor parameters in groups of their own): the per-parameter state loads by
            # name, the groups and their settings are this run's (the scheduler restores lr and wd).
            self._kept_groups = targets.pop("param_groups")
        self._targets = targets
        return targets

    def load_state_dict(self, state: dict) -> None:
        if self._kept_groups is not None:
            state["param_groups"] = self._kept_groups
        self._targets = self._kept_groups = None
        set_optimizer_state_dict(self.owner, self.optimizer, state)


class MainParamsState(Stateful):
    """The optimizer's fp32 main params (a bf16 or fp16 model)."""

    def __init__(self, model: nn.Module, optimizer):
        self.module, self.optimizer = unwrap_model(model), optimizer

    def state_dict(self) -> dict:
        return self.optimizer.main_params_state_dict(self.module)

    def load_state_dict(self, state: dict) -> None:
        pass  # NOTE: state_dict() gives the live main params: DCP has read into them in place


class EntryState(Stateful):
    """An object's plain state (its state_dict(): the scheduler, the loss scaler, the train
    state) as one checksummed blob; a load gives the unpacked value back."""

    def __init__(self, source: HasState):
        self.source = source

    def state_dict(self) -> bytes:
        return entries.pack(self.source.state_dict())

    def load_state_dict(self, state: Any) -> None:
        self.source.load_state_dict(state)


class Computed:
    """A value made when a save asks for it (`make()`), with the state protocol: the train state
    of one save, the loss scaler's state on the CPU. Made inside the manager's save, a failure
    on one rank is every rank's."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make

    def state_dict(self) -> Any:
        return self._make()

    def load_state_dict(self, state: Any) -> None:
        raise TypeError("a computed checkpoint entry is only saved")


def rng_key(rank: int) -> str:
    return f"rank_{rank:05d}"


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch_cpu": torch.get_rng_state(),
             "tracker": tp_random.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    tp_random.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class RNGState(Stateful):
    """This rank's RNG states (Python, torch's CPU and CUDA generators, the model-parallel
    tracker) under its own key: every rank writes one."""

    def __init__(self, key: Optional[str] = None):
        self.key = key or rng_key(get_rank_safe())

    def state_dict(self) -> dict:
        return {self.key: entries.pack(rng_state())}

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)
