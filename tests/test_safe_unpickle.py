"""Loading a checkpoint never runs code from it (dist_checkpointing/safe_unpickle.py): crafted
checkpoints whose pickles would write a file, in Megatron-Core's layouts and in ours, are refused
in one line naming what they would have called, and the file is never written; Megatron-Core's
own types load without megatron-core."""

import argparse
import enum
import glob
import io
import json
import os
import pickle
import shutil
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from megatron_fsdp.dist_checkpointing import mcore, safe_unpickle, torch_dcp
from megatron_fsdp.dist_checkpointing.core import CheckpointError

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the tests' own DCP calls


class _WritesAFile:
    """Unpickled without the weights-only unpickler, this opens (creates) `path` for writing."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _pickle(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _dcp_checkpoint(path, entries: dict) -> str:
    """A DCP checkpoint holding `entries`, each value pickled by DCP (as our entries' bytes are)."""
    dcp.save(entries, checkpoint_id=str(path), no_dist=True)
    return str(path)


class _AsMegatronCoreWritesIt(DefaultSavePlanner):
    """Each non-tensor value stored as its own torch.save bytes, one entry (megatron-core's layout,
    which DCP's default planner unpickles as it loads)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def resolve_data(self, write_item):
        found = self.lookup_object(write_item.index)
        if torch.is_tensor(found):
            return super().resolve_data(write_item)
        data = io.BytesIO()
        torch.save(found, data)
        return data


def _mcore_checkpoint(tmp_path, common: list, layout: str) -> str:
    ckpt = tmp_path / "mcore" / "iter_0000001"
    ckpt.mkdir(parents=True)
    (tmp_path / "mcore" / "latest_checkpointed_iteration.txt").write_text("1")
    if layout == "dcp":  # as megatron-core 0.19 writes it: the common state's pickle, one DCP entry
        dcp.save({mcore.COMMON: common}, checkpoint_id=str(ckpt), no_dist=True, planner=_AsMegatronCoreWritesIt())
    else:  # Megatron-Core's earlier layout: common.pt beside the DCP files
        _dcp_checkpoint(ckpt, {"embedding.word_embeddings.weight": torch.zeros(1)})
        (ckpt / "common.pt").write_bytes(_pickle(common))
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    return str(tmp_path / "mcore")


@pytest.mark.parametrize("layout", ["dcp", "common.pt"])
def test_a_megatron_core_checkpoint_whose_common_state_runs_code_is_refused(tmp_path, layout):
    marker = tmp_path / "written_by_the_checkpoint"
    ckpt = _mcore_checkpoint(tmp_path, [{"args": _WritesAFile(str(marker))}], layout)
    with pytest.raises(CheckpointError) as refused:
        mcore.McoreReader(ckpt)
    assert "refused to unpickle io.open" in str(refused.value) and len(str(refused.value).splitlines()) == 1
    assert not marker.exists()


def test_the_converter_refuses_it_in_one_line_and_writes_nothing(tmp_path):
    from helpers import run_convert

    marker = tmp_path / "written_by_the_checkpoint"
    ckpt = _mcore_checkpoint(tmp_path, [{"args": _WritesAFile(str(marker))}], "dcp")
    code, out, err = run_convert("--model-type", "GPT", "--loader", "mcore", "--saver", "megatron_fsdp",
                                 "--load-dir", ckpt, "--save-dir", tmp_path / "out")
    assert code != 0 and not marker.exists() and not (tmp_path / "out").exists()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "refused to unpickle io.open" in lines[0], err


def test_our_own_checkpoint_entries_and_extra_state_are_read_safely(tmp_path):
    marker = tmp_path / "written_by_the_checkpoint"
    ckpt = _dcp_checkpoint(tmp_path / "ours", {"train_state": _WritesAFile(str(marker)),
                                               "rng.rank_0": b"an entry's bytes"})
    assert torch_dcp.read_entries(ckpt, ["rng.rank_0"]) == {"rng.rank_0": b"an entry's bytes"}
    with pytest.raises(CheckpointError, match="refused to unpickle io.open"):
        torch_dcp.read_entries(ckpt, ["train_state"])
    assert not marker.exists()


def test_module_extra_state_in_a_training_checkpoint_is_read_safely(tmp_path):
    """A module's extra state (the fp8 histories) goes through load_checkpoint's own planner: one
    whose pickle would create a file is refused, naming its entry."""
    from megatron_fsdp.training.checkpointing import load_checkpoint, save_checkpoint

    marker = tmp_path / "written_by_the_checkpoint"

    class WithExtraState(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def get_extra_state(self):
            return _WritesAFile(str(marker))  # pickled as a call of open(): never called while saving

        def set_extra_state(self, state):
            pass

    model = WithExtraState()
    save_checkpoint(1, model, None, None, str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(model, None, None, str(tmp_path / "ckpt"))
    message = str(refused.value)
    assert "checkpoint entry model._extra_state: refused to unpickle io.open" in message, message
    assert len(message.splitlines()) == 1 and not marker.exists()


def _with_metadata(tmp_path, fixture: str, metadata: bytes) -> str:
    """A copy of tests/data/`fixture` whose iteration's `.metadata` is `metadata`, its checksum (if
    any) dropped from checksums.json as whoever crafted it would."""
    copy = tmp_path / fixture
    shutil.copytree(os.path.join(DATA, fixture), copy)
    (ckpt,) = copy.glob("iter_*")
    (ckpt / ".metadata").write_bytes(metadata)
    manifest = ckpt / "checksums.json"
    if manifest.exists():
        recorded = json.loads(manifest.read_text())
        del recorded["files"][".metadata"]
        manifest.write_text(json.dumps(recorded))
    return str(copy)


@pytest.mark.parametrize("fixture", ["checkpoint_v3_interleaved", "mcore_torch_dist"])
def test_a_dcp_metadata_file_that_runs_code_is_refused_by_every_reader(tmp_path, fixture):
    """DCP's own FileSystemReader unpickles `.metadata` with pickle.load; every reader of ours
    (metadata, entries, a training load, the offline reader, the converter) refuses the call."""
    from helpers import run_convert

    from megatron_fsdp.training import checkpointing, offline_checkpoint

    marker = tmp_path / "written_by_the_checkpoint"
    ckpt = _with_metadata(tmp_path, fixture, pickle.dumps(_WritesAFile(str(marker))))
    (path,) = glob.glob(os.path.join(ckpt, "iter_*"))
    if fixture == "mcore_torch_dist":
        readers = [lambda: mcore.McoreReader(ckpt)]
    else:
        readers = [lambda: torch_dcp.read_metadata(path), lambda: torch_dcp.read_entries(path, ["rng.rank_0"]),
                   lambda: offline_checkpoint.CheckpointReader(ckpt),
                   lambda: checkpointing.load_checkpoint(torch.nn.Linear(2, 2), None, None, ckpt)]
    for read in readers:
        with pytest.raises(CheckpointError) as refused:
            read()
        assert "refused to unpickle io.open" in str(refused.value), str(refused.value)
        assert len(str(refused.value).splitlines()) == 1
    code, out, err = run_convert("--model-type", "GPT", "--loader", "mcore" if "mcore" in fixture else "megatron_fsdp",
                                 "--saver", "hf", "--load-dir", ckpt, "--save-dir", tmp_path / "out")
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "refused to unpickle io.open" in lines[0], err
    assert not marker.exists() and not (tmp_path / "out").exists()


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as getattr(cls, name), as Python does for some enums (torch 2.14's
    _MEM_FORMAT_ENCODING among them)."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_getattr_in_metadata_reaches_enum_members_only(tmp_path):
    metadata = safe_unpickle.SafeFileSystemReader(os.path.join(DATA, "checkpoint_v3_interleaved",
                                                               "iter_0000002")).read_metadata()
    buffer = io.BytesIO()
    _EnumsByName(buffer).dump(metadata)
    assert b"getattr" in buffer.getvalue()
    (tmp_path / "by_name").mkdir()
    (tmp_path / "by_name" / ".metadata").write_bytes(buffer.getvalue())
    again = safe_unpickle.SafeFileSystemReader(str(tmp_path / "by_name")).read_metadata()
    assert again.state_dict_metadata == metadata.state_dict_metadata

    class _ReachesAFunction:  # getattr(torch.Size, "__init__"): a step towards any code
        def __reduce__(self):
            return getattr, (torch.Size, "__init__")

    (tmp_path / "reach").mkdir()
    (tmp_path / "reach" / ".metadata").write_bytes(pickle.dumps(_ReachesAFunction()))
    with pytest.raises(CheckpointError, match=r"reach/\.metadata: refused to unpickle builtins\.getattr"):
        safe_unpickle.SafeFileSystemReader(str(tmp_path / "reach")).read_metadata()


@pytest.mark.parametrize("damage", ["other bytes", "cut short"])
def test_damaged_metadata_and_common_state_are_one_line_naming_the_file(tmp_path, damage):
    from helpers import run_convert

    def damaged(data: bytes) -> bytes:
        return os.urandom(len(data)) if damage == "other bytes" else data[: len(data) // 2]

    metadata = open(os.path.join(DATA, "mcore_torch_dist", "iter_0000003", ".metadata"), "rb").read()
    ckpt = _with_metadata(tmp_path, "mcore_torch_dist", damaged(metadata))
    code, _, err = run_convert("--model-type", "GPT", "--loader", "mcore", "--saver", "megatron_fsdp",
                               "--load-dir", ckpt, "--save-dir", tmp_path / "out")
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and ".metadata is corrupt" in lines[0], err
    # Megatron-Core's earlier layout: common.pt beside the DCP files.
    common = _pickle([{"args": argparse.Namespace(num_layers=1)}])
    older = _mcore_checkpoint(tmp_path / "older", [], "common.pt")
    (common_pt,) = glob.glob(os.path.join(older, "iter_*", "common.pt"))
    with open(common_pt, "wb") as f:
        f.write(damaged(common))
    code, _, err = run_convert("--model-type", "GPT", "--loader", "mcore", "--saver", "megatron_fsdp",
                               "--load-dir", older, "--save-dir", tmp_path / "out")
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "common.pt is corrupt" in lines[0], err
    assert not (tmp_path / "out").exists()


def test_megatron_cores_own_types_load_without_megatron_core(monkeypatch):
    # Pickled as megatron-core pickles them (its module names, stood in here only while pickling),
    # then read with megatron-core absent.
    enums = types.ModuleType("megatron.core.enums")

    class ModelType(enum.Enum):
        encoder_or_decoder = 1

    ModelType.__module__, ModelType.__qualname__ = enums.__name__, "ModelType"
    enums.ModelType = ModelType
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, enums.__name__, enums)
    import numpy

    args = argparse.Namespace(num_layers=2, model_type=ModelType.encoder_or_decoder, params_dtype=torch.bfloat16,
                              save=None, rng=numpy.arange(3, dtype=numpy.uint32))
    blob = _pickle([{"args": args, "iteration": 7}])
    monkeypatch.undo()
    assert "megatron.core.enums" not in sys.modules
    (common,) = safe_unpickle.load(io.BytesIO(blob), "common state", safe_unpickle.MEGATRON_CORE_GLOBALS)
    loaded = common["args"]
    assert (loaded.num_layers, loaded.params_dtype, common["iteration"]) == (2, torch.bfloat16, 7)
    assert loaded.model_type.megatron_core_class == "megatron.core.enums.ModelType"
    # Pickled by value, or by name as torch 2.14's torch.save pickles every enum member.
    assert vars(loaded.model_type) in ({"value": 1}, {"name": "encoder_or_decoder"}), vars(loaded.model_type)
    assert loaded.rng.tolist() == [0, 1, 2] and "megatron.core.enums" not in sys.modules
    # Our own checkpoints allow no Megatron-Core type: the same blob is refused there.
    with pytest.raises(CheckpointError, match="refused to unpickle argparse.Namespace"):
        safe_unpickle.load(io.BytesIO(blob), "our entry")
