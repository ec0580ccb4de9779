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

from helpers import tiered
from megatron_fsdp.dist_checkpointing import checksums, entries, torch_dcp
from megatron_fsdp.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "data", "checkpoint_v2")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the tests' own DCP calls


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
    assert found["train_state"]["iteration"] == 5 and found["train_state"]["version"] == 4
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


# ------------------------------------------ format 3: a gated fc1 stored with interleaved rows

FIXTURE_V3 = os.path.join(HERE, "data", "checkpoint_v3_interleaved")


def _v3_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_checkpoint_v3_interleaved",
                                                  os.path.join(HERE, "data", "make_checkpoint_v3_interleaved.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case_format_3_fc1(ckpt, tp, fsdp, save_to):
    """Load the format-3 fixture at this layout; every tensor of fc1 (weights, fp32 main params,
    Adam moments) comes back in the [gate; up] layout, announced once; a save stores that layout."""
    import logging

    import torch.distributed as dist

    from helpers import full_tensor, setup_parallel
    from megatron_fsdp.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel

    setup_parallel(tp, seed=11)
    module = _v3_module()
    model, optimizer = module.build()
    if fsdp:
        model = TorchFullyShardedDataParallel(model.config, DistributedDataParallelConfig(), model)
        optimizer = module.get_megatron_optimizer(
            module.OptimizerConfig(lr=1e-2, bf16=True, params_dtype=torch.bfloat16), model)
    inner = getattr(model, "module", model)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("megatron_fsdp.training.checkpointing")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        load_checkpoint(model, optimizer, None, ckpt, true_vocab_size=module.VOCAB)
    finally:
        logger.removeHandler(handler)
    expected = torch.load(os.path.join(ckpt, "expected.pt"), weights_only=True)
    strides = {n: getattr(p, "partition_stride", 1) for n, p in inner.named_parameters()}
    assert {n for n, s in strides.items() if s == 2} == {f"decoder.layers.{i}.mlp.linear_fc1.{w}"
                                                         for i in range(2) for w in ("weight", "bias")}
    vocab = module.VOCAB
    for name, p in inner.named_parameters():
        got = full_tensor(p.detach(), strides[name]).float()[:vocab] if "embedding" in name or "output" in name \
            else full_tensor(p.detach(), strides[name]).float()
        torch.testing.assert_close(got, expected["params"][name].float(), rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")
    state = torch_dcp.sharded_state(model, optimizer)
    for name, values in state["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            got = full_tensor(values[key], strides[name])
            torch.testing.assert_close(got[:expected[key][name].shape[0]], expected[key][name], rtol=0, atol=0,
                                       msg=lambda m: f"{name} {key}: {m}")
    for name, main in state.get("main_params", {}).items():
        got = full_tensor(main, strides[name])
        torch.testing.assert_close(got[:expected["main_params"][name].shape[0]], expected["main_params"][name],
                                   rtol=0, atol=0, msg=lambda m: f"main param {name}: {m}")
    said = [r.getMessage() for r in records if "interleaved" in r.getMessage()]
    if dist.get_rank() == 0:
        assert len(said) == 1 and "converted" in said[0] and "format 4" in said[0], said
    else:
        assert not said
    if save_to:
        save_checkpoint(3, model, optimizer, None, save_to, true_vocab_size=vocab)
    return sorted(state.get("main_params", {}))


@pytest.mark.parametrize("world_size,tp,fsdp", tiered([(1, 1, False), (2, 2, False), (4, 2, True)],
                                                    [(1, 1, False), (2, 2, False)]))
def test_format_3_checkpoint_with_interleaved_fc1_loads_converted(pools, tmp_path, world_size, tp, fsdp):
    ckpt = str(tmp_path / "v3")
    shutil.copytree(FIXTURE_V3, ckpt)
    save_to = str(tmp_path / "resaved") if world_size == 4 else None
    mains = pools(world_size).run(_case_format_3_fc1, ckpt, tp, fsdp, save_to)[0]
    assert fsdp or mains, "the fixture's fp32 main params were loaded"
    if save_to:
        # Saved again (format 4) from TP=2 x DP=2: the stored fc1 is the full [gate; up] tensor.
        expected = torch.load(os.path.join(ckpt, "expected.pt"), weights_only=True)["params"]
        name = "decoder.layers.1.mlp.linear_fc1.weight"
        stored = {f"model.{name}": torch.empty(expected[name].shape, dtype=torch.float32)}
        dcp.load(stored, checkpoint_id=os.path.join(save_to, "iter_0000003"), no_dist=True)
        torch.testing.assert_close(stored[f"model.{name}"], expected[name].float(), rtol=0, atol=0)


def test_a_newer_format_version_is_refused(tmp_path):
    ckpt = str(tmp_path / "v3")
    shutil.copytree(FIXTURE_V3, ckpt)
    from megatron_fsdp.training import checkpointing
    real = checkpointing._FORMAT_VERSION
    checkpointing._FORMAT_VERSION = 2
    try:
        with pytest.raises(CheckpointError, match="format version 3, written by a newer megatron_fsdp; this "
                                                  "one reads versions up to 2"):
            load_checkpoint(torch.nn.Linear(1, 1), None, None, ckpt, verify=False)
    finally:
        checkpointing._FORMAT_VERSION = real


def test_the_offline_reader_gives_a_format_3_fc1_as_gate_then_up():
    """tools/checkpoint/convert.py's reader of our checkpoints (one tensor at a time, no model):
    a format-3 gated fc1 comes back in the [gate; up] layout, as a load into a model does."""
    from megatron_fsdp.training.offline_checkpoint import CheckpointReader

    expected = torch.load(os.path.join(FIXTURE_V3, "expected.pt"), weights_only=True)["params"]
    reader = CheckpointReader(FIXTURE_V3)
    assert reader.version == 3 and reader.true_vocab_size == 64
    for name in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.bias",
                 "decoder.layers.0.mlp.linear_fc2.weight", "decoder.final_layernorm.weight"):
        assert torch.equal(reader.tensor(name), expected[name]), name
