"""Loading a checkpoint never runs code from it.

A checkpoint's non-tensor values are pickles: our entries (entries.py), module
extra state (the fp8 histories), Megatron-Core's common state (`common.pt`, or
`common_state/shard_0_1` in its DCP files). Unpickling runs whatever callables
the pickle names, so a checkpoint from anywhere could run code on the machine
that loads or converts it, and DCP's own DefaultLoadPlanner unpickles such
values with `weights_only=False`. Here every one goes through torch's
`weights_only` unpickler, which builds only tensors, containers, numbers and
strings, and the types listed below; anything else is refused in one line that
names it. Megatron-Core reads its common state the same way (its
`safe_globals.py`); its own types are stood in for here, under their names,
without importing megatron-core.
"""

from __future__ import annotations

import argparse
import io
import pathlib
import pickle
import re
import signal
import types

import numpy
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from .. import _torch_compat
from .core import CheckpointError

# What our own checkpoints hold besides tensors and plain values: module extra state (BytesIO).
OWN_GLOBALS = [io.BytesIO]


class MegatronCoreObject(types.SimpleNamespace):
    """An instance of one of Megatron-Core's own classes (enum members, OptimizerConfig) read from
    its common state: `megatron_core_class` names it, `value` holds an enum member's value,
    the other attributes a dataclass's fields."""

    megatron_core_class = "?"

    def __init__(self, value=None):
        super().__init__()
        if value is not None:
            self.value = value


def _stand_in(qualified_name: str) -> tuple[type, str]:
    cls = type(qualified_name.rsplit(".", 1)[1], (MegatronCoreObject,), {"megatron_core_class": qualified_name})
    return cls, qualified_name


# megatron-core 0.19's SAFE_GLOBALS (megatron/core/safe_globals.py), theirs stood in by name.
_MCORE_CLASSES = ["megatron.core.enums.ModelType", "megatron.core.optimizer.OptimizerConfig",
                  "megatron.core.optimizer.optimizer_config.OptimizerConfig",
                  "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
                  "megatron.core.rerun_state_machine.RerunState", "megatron.core.transformer.enums.AttnBackend",
                  "megatron.core.transformer.enums.CudaGraphModule", "megatron.core.transformer.enums.CudaGraphScope",
                  "megatron.core.transformer.enums.InferenceCudaGraphScope"]
_NUMPY_CORE = getattr(numpy, "_core", None) or numpy.core  # numpy 2 renamed numpy.core
_NUMPY = [(numpy.ndarray, "numpy.ndarray"), (numpy.dtype, "numpy.dtype"),
          (numpy.dtype("uint32").__class__, "numpy.dtypes.UInt32DType")]
_NUMPY += [(_NUMPY_CORE.multiarray._reconstruct, f"{module}.multiarray._reconstruct")
           for module in ("numpy.core", "numpy._core")]  # the name numpy 1 and numpy 2 pickle it under
MEGATRON_CORE_GLOBALS = [*OWN_GLOBALS, argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals,
                         torch.Generator, *_NUMPY, *(_stand_in(name) for name in _MCORE_CLASSES)]


def load(stream, what: str, allowed=OWN_GLOBALS):
    """torch.load(stream) through the weights-only unpickler, `allowed` besides what it builds
    anyway; CheckpointError naming `what` and the refused name instead of running anything."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(stream, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        refused = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(exc))
        named = refused[1] if refused else str(exc).strip().splitlines()[0]
        raise CheckpointError(f"{what}: refused to unpickle {named}: loading a checkpoint never runs code from "
                              "it, and this is no type a checkpoint holds") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with its non-tensor values unpickled by `load` (DefaultLoadPlanner's own
    load_bytes uses weights_only=False); `allowed` as there."""

    def __init__(self, *args, allowed=OWN_GLOBALS, **kwargs):
        super().__init__(*args, **kwargs)
        self.allowed = allowed

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load(value, f"checkpoint entry {fqn}", self.allowed)
        # NOTE: where DefaultLoadPlanner.load_bytes puts the value.
        if self.flatten_state_dict:
            _torch_compat.set_state_dict_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
