"""The checkpoint format: one DCP dict whose non-tensor entries are checksummed
blobs (format 3), and the format 2 checkpoint in tests/data/checkpoint_v2 (DCP
tensors, common.pt, rng/), written by the last version that wrote it, still
loading with everything it held."""

import os
import random
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from megatron_fsdp.dist_checkpointing import checksums, entries, torch_dcp
from megatron_fsdp.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "data", "checkpoint_v2")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _build(seed):
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_checkpoint_v2", os.path.join(HERE, "data",
                                                                                      "make_checkpoint_v2.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(seed)


def _fixture_copy(tmp_path) -> str:
    path = str(tmp_path / "v2")
    shutil.copytree(FIXTURE, path)
    return path


def test_format_2_checkpoint_loads_everything_it_holds(tmp_path):
    ckpt = _fixture_copy(tmp_path)
    assert sorted(os.listdir(os.path.join(ckpt, "iter_0000003"))) == [
        ".metadata", "__0_0.distcp", "checksums.json", "common.pt", "rng"]
    expected = torch.load(os.path.join(ckpt, "expected.pt"), weights_only=True)
    model, optimizer, scheduler = _build(seed=1)
    assert not torch.equal(model[0].weight, expected["params"]["0.weight"])
    random.seed(0)
    torch.manual_seed(0)
    loaded = load_checkpoint(model, optimizer, scheduler, ckpt)
    assert (loaded["iteration"], loaded["extra_state"], loaded["rng_restored"]) == (
        3, {"consumed_train_samples": 24}, True)
    # The RNG states as saved: the next draws are the ones drawn after the save.
    assert torch.equal(torch.rand(3), expected["next_torch_rand"])
    assert random.random() == expected["next_python_random"]
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), expected["params"][name]), name
    mains = optimizer.main_params_state_dict(model)
    for name, t in expected["main_params"].items():
        assert torch.equal(mains[name], t), name
    inner = optimizer.optimizer
    got = [inner.state[p]["exp_avg"] for g in inner.param_groups for p in g["params"]]
    assert len(got) == len(expected["exp_avg"]) and all(torch.equal(a, b) for a, b in zip(got, expected["exp_avg"]))
    assert {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in optimizer.grad_scaler.state_dict().items()} \
        == {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in expected["grad_scaler"].items()}
    assert scheduler.num_steps == expected["scheduler_num_steps"]
    assert optimizer.param_groups[0]["lr"] == expected["lr"]


def test_format_2_checkpoint_without_a_ranks_rng_state_is_named(tmp_path):
    ckpt = _fixture_copy(tmp_path)
    os.remove(os.path.join(ckpt, "iter_0000003", "rng", "rank_00000.pt"))
    model, optimizer, scheduler = _build(seed=1)
    with pytest.raises(CheckpointError, match="has no RNG state for rank 0.*--no-load-rng"):
        load_checkpoint(model, optimizer, scheduler, ckpt, verify=False)
    assert load_checkpoint(model, optimizer, scheduler, ckpt, verify=False, load_rng=False)["iteration"] == 3


def _saved(tmp_path):
    model, optimizer, scheduler = _build(seed=0)
    loss = model(torch.ones(2, 4, dtype=torch.float16)).float().square().sum()
    optimizer.scale_loss(loss).backward()
    optimizer.step()
    scheduler.step()
    path = save_checkpoint(5, model, optimizer, scheduler, str(tmp_path / "v3"), extra_state={"answer": 42})
    return path, model, optimizer, scheduler


def test_one_dcp_dict_holds_every_entry(tmp_path):
    path, model, optimizer, scheduler = _saved(tmp_path)
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", checksums.MANIFEST_FILENAME]
    saved = torch_dcp.read_metadata(path)
    own = ["grad_scaler", "opt_param_scheduler", "rng.rank_00000", "train_state"]
    assert all(isinstance(saved[name], BytesStorageMetadata) for name in own)
    assert any(k.startswith("model.") for k in saved) and any(k.startswith("main_params.") for k in saved)
    found = {n: entries.unpack(b, n) for n, b in torch_dcp.read_entries(path, own).items()}
    assert found["train_state"]["iteration"] == 5 and found["train_state"]["version"] == 3
    assert found["train_state"]["extra_state"] == {"answer": 42}
    assert found["opt_param_scheduler"] == scheduler.state_dict()
    assert float(found["grad_scaler"]["scale"]) == float(optimizer.grad_scaler.scale)
    # The entries are what a plain DCP load of the same keys reads, too.
    plain = {"train_state": b""}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert entries.unpack(plain["train_state"], "train_state")["iteration"] == 5


def test_a_damaged_entry_is_refused_without_the_file_checksums(tmp_path):
    path, model, optimizer, scheduler = _saved(tmp_path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    where = next(info for index, info in metadata.storage_data.items() if index.fqn == "train_state")
    with open(os.path.join(path, where.relative_path), "r+b") as f:
        f.seek(where.offset + where.length // 2)  # inside the entry's payload
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    # Read before the files are verified (and with verify=False), the entry checks itself.
    for verify in (False, True):
        with pytest.raises(CheckpointError, match="its train_state entry is corrupt: checksum mismatch"):
            load_checkpoint(model, optimizer, scheduler, os.path.dirname(path), verify=verify)


def test_entries_round_trip_and_name_what_is_wrong():
    state = {"num_steps": 7, "scale": torch.tensor(2.0), "nested": {"a": [1, 2]}}
    blob = entries.pack(state)
    back = entries.unpack(blob, "x")
    assert back["num_steps"] == 7 and torch.equal(back["scale"], state["scale"]) and back["nested"] == {"a": [1, 2]}
    with pytest.raises(CheckpointError, match="the scheduler is not a checkpoint entry of this format"):
        entries.unpack(b"PK\x03\x04 a bare torch.save", "the scheduler")
    damaged = bytearray(blob)
    damaged[-30] ^= 1
    with pytest.raises(CheckpointError, match="the scheduler is corrupt: checksum mismatch"):
        entries.unpack(bytes(damaged), "the scheduler")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        entries.unpack(blob, "x")  # weights_only: no pickle warning, no code run
