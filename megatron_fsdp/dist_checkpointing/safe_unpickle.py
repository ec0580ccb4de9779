"""Loading a checkpoint never runs code from it.

A checkpoint's non-tensor values are pickles: DCP's `.metadata` file, our
entries (entries.py), module extra state (the fp8 histories), Megatron-Core's
common state (`common.pt`, or `common_state/shard_0_1` in its DCP files).
Unpickling runs whatever callables the pickle names, so a checkpoint from
anywhere could run code on the machine that loads or converts it: DCP's own
FileSystemReader reads `.metadata` with `pickle.load`, and its
DefaultLoadPlanner unpickles values with `weights_only=False`. Here `.metadata`
is read by SafeFileSystemReader, which builds only DCP's metadata types, and
every value goes through torch's `weights_only` unpickler, which builds only
tensors, containers, numbers and strings, and the types listed below; anything
else is refused in one line that names it. Megatron-Core reads its common state
the same way (its `safe_globals.py`); its own types are stood in for here,
under their names, without importing megatron-core.
"""

from __future__ import annotations

import argparse
import enum
import io
import os
import pathlib
import pickle
import re
import signal
import types
from typing import Optional

import numpy
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import _torch_compat
from .core import CheckpointError, describe

# What our own checkpoints hold besides tensors and plain values: module extra state (BytesIO).
OWN_GLOBALS = [io.BytesIO]


class MegatronCoreObject(types.SimpleNamespace):
    """An instance of one of Megatron-Core's own classes (enum members, OptimizerConfig) read from
    its common state: `megatron_core_class` names it, `value` holds an enum member's value (or
    `name` its name, where torch 2.14 pickled it by name), the other attributes a dataclass's fields."""

    megatron_core_class = "?"

    def __init__(self, value=None):
        super().__init__()
        if value is not None:
            self.value = value


def _stand_in(qualified_name: str) -> tuple[type, str]:
    cls = type(qualified_name.rsplit(".", 1)[1], (MegatronCoreObject,), {"megatron_core_class": qualified_name})
    return cls, qualified_name


def _enum_member(cls, name):
    """What `builtins.getattr` stands for in what we unpickle: an enum member by name, nothing
    else (getattr itself would reach any attribute of what the pickle holds, and through it any
    code). torch 2.14 pickles every enum member so, as getattr(cls, name): its `.metadata`'s
    _MEM_FORMAT_ENCODING, Megatron-Core's enums in a common state it saved."""
    if isinstance(name, str) and not name.startswith("_"):
        if isinstance(cls, enum.EnumMeta) and name in cls.__members__:
            return cls[name]
        if isinstance(cls, type) and issubclass(cls, MegatronCoreObject):  # one of its enums, stood in
            member = cls()
            member.name = name
            return member
    raise pickle.UnpicklingError(f"global builtins.getattr (of {getattr(cls, '__name__', type(cls).__name__)}, "
                                 f"{name!r}: not an enum member)")


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
                         torch.Generator, *_NUMPY, *(_stand_in(name) for name in _MCORE_CLASSES),
                         (_enum_member, "builtins.getattr")]


def _refused(what: str, name: str) -> CheckpointError:
    return CheckpointError(f"{what}: refused to unpickle {name}: loading a checkpoint never runs code from it, "
                           "and this is no type a checkpoint holds")


def load(stream, what: str, allowed=OWN_GLOBALS):
    """torch.load(stream) through the weights-only unpickler, `allowed` besides what it builds
    anyway; CheckpointError naming `what` and the refused name instead of running anything, or
    saying that `what` is corrupt when it is no pickle torch reads."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(stream, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        refused = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(exc))
        if refused:
            raise _refused(what, refused[1]) from None
        raise CheckpointError(f"{what} is corrupt: not a pickle torch reads safely "
                              f"({str(exc).strip().splitlines()[0]})") from None
    except Exception as exc:  # cut short, other bytes, a stand-in called with what it does not take
        raise CheckpointError(f"{what} is corrupt ({describe(exc)})") from None


# What DCP's `.metadata` pickle names (torch 2.11-2.14, and Megatron-Core's checkpoints, whose
# planner keeps its SavePlan there): DCP's metadata types, torch.Size, layouts (through
# torch.serialization's lookup by name), the checkpoint_id's path; and torch's dtypes, layouts
# and memory formats, by name (_MetadataUnpickler).
DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath"},  # where Python 3.13 defines them
    "collections": {"OrderedDict"},
}




class _MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that resolves only DCP_METADATA_GLOBALS, torch's dtypes, layouts and
    memory formats, and enum members by name: whatever else a `.metadata` names is refused before
    it is called."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        # NOTE: exact names only; a dotted name (pickle walks attributes for it) matches none.
        torch_constant = module == "torch" and isinstance(getattr(torch, name, None),
                                                          (torch.dtype, torch.layout, torch.memory_format))
        if name in DCP_METADATA_GLOBALS.get(module, ()) or torch_constant:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader whose `.metadata` is unpickled by _MetadataUnpickler
    (FileSystemReader.read_metadata uses pickle.load: any callable a file names). Opened by
    `open_checkpoint`, which reads the metadata first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._metadata: Optional[Metadata] = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is None and self._metadata is not None:
            return self._metadata  # read once, by open_checkpoint
        self._metadata = self._read_metadata(kwargs.get("rank"))
        return self._metadata

    def _read_metadata(self, rank: Optional[int]) -> Metadata:
        path = _torch_compat.dcp_metadata_path(self, rank)
        what = os.path.join(str(self.path), os.path.basename(str(path)))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as exc:
                refused = re.match(r"global ([\w.]+)", str(exc))
                if refused:
                    raise _refused(what, refused[1]) from None
                raise CheckpointError(f"{what} is corrupt ({describe(exc)})") from None
            except Exception as exc:  # cut short (EOFError), other bytes
                raise CheckpointError(f"{what} is corrupt ({describe(exc)})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{what} is corrupt: it holds a {type(metadata).__name__}, not DCP's Metadata")
        # NOTE: what FileSystemReader.read_metadata does after unpickling.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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


def open_checkpoint(path: str) -> SafeFileSystemReader:
    """A SafeFileSystemReader of `path` whose metadata is read (a refused or corrupt `.metadata`
    raises its one line here: dcp.load would take the error for a missing file and say only
    "metadata is None"); dcp.load(storage_reader=...) then reads it from the reader."""
    reader = SafeFileSystemReader(path)
    reader.read_metadata()
    return reader
