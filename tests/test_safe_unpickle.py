"""Loading a checkpoint never runs code from it (dist_checkpointing/safe_unpickle.py): crafted
checkpoints whose pickles would write a file, in Megatron-Core's layouts and in ours, are refused
in one line naming what they would have called, and the file is never written; Megatron-Core's
own types load without megatron-core."""

import argparse
import enum
import io
import json
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

from megatron_fsdp.dist_checkpointing import mcore, safe_unpickle, torch_dcp
from megatron_fsdp.dist_checkpointing.core import CheckpointError

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
    assert loaded.model_type.megatron_core_class == "megatron.core.enums.ModelType" and loaded.model_type.value == 1
    assert loaded.rng.tolist() == [0, 1, 2] and "megatron.core.enums" not in sys.modules
    # Our own checkpoints allow no Megatron-Core type: the same blob is refused there.
    with pytest.raises(CheckpointError, match="refused to unpickle argparse.Namespace"):
        safe_unpickle.load(io.BytesIO(blob), "our entry")
