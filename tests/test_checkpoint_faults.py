"""Checkpoint faults a user meets: ranks that see different trackers, corrupt
shards, a missing --load path. Each must end the same way on every rank, in
bounded time."""

import builtins
import glob
import io
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from helpers import full_params, on_rank_zero
from megatron_fsdp.dist_checkpointing import checksums
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training import checkpointing
from megatron_fsdp.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint
from test_checkpointing import _build, _train

TRACKER = checkpointing.TRACKER_FILENAME
# A case that should fail fast but hangs (ranks in different collectives) ends here.
TIMEOUT = 60
# Shards of a few KiB, so that a 4 KiB flip can land inside one tensor's bytes.
HIDDEN = 128


def _case_two_checkpoints(ckpt):
    model, optimizer, scheduler = _build(2, fsdp=True, hidden_size=HIDDEN)
    _train(model, optimizer, scheduler, 1, 1)
    save_checkpoint(3, model, optimizer, scheduler, ckpt)
    _train(model, optimizer, scheduler, 2, 2)
    save_checkpoint(6, model, optimizer, scheduler, ckpt)


@pytest.fixture(scope="module")
def two_checkpoints(pools, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("two"))
    pools(4).run(_case_two_checkpoints, ckpt)
    return ckpt


# ------------------------------------------------------- 8: one iteration for every rank


def _case_tracker_differs_between_ranks(ckpt, fault):
    """Ranks other than 0 see another tracker than rank 0 does: rewritten
    between the reads (iteration 3 instead of 6) or gone."""
    real_open, real_isfile = builtins.open, os.path.isfile

    def is_tracker(path):
        return isinstance(path, (str, os.PathLike)) and os.path.basename(str(path)) == TRACKER

    def faulty_open(path, *args, **kwargs):
        if is_tracker(path):
            if fault == "vanished":
                raise FileNotFoundError(2, "No such file or directory (injected)", str(path))
            return io.StringIO("3\n")
        return real_open(path, *args, **kwargs)

    def faulty_isfile(path):
        return False if fault == "vanished" and is_tracker(path) else real_isfile(path)

    model, optimizer, scheduler = _build(2, fsdp=True, hidden_size=HIDDEN)
    if dist.get_rank() != 0:
        builtins.open, os.path.isfile = faulty_open, faulty_isfile
    try:
        latest = checkpointing.read_latest_iteration(ckpt)
        loaded = load_checkpoint(model, optimizer, scheduler, ckpt)
    finally:
        builtins.open, os.path.isfile = real_open, real_isfile
    weights = full_params(model.module)
    return latest, loaded["iteration"], scheduler.num_steps, sum(float(w.double().sum()) for w in weights.values())


@pytest.mark.slow  # pool cases on a 4-rank run of their own (the fixture); faults' representatives: test_checksums.py
@pytest.mark.parametrize("fault", ["rewritten", "vanished"])
def test_every_rank_loads_the_iteration_rank0_read(pools, two_checkpoints, fault):
    results = pools(4).run(_case_tracker_differs_between_ranks, two_checkpoints, fault, timeout=TIMEOUT)
    assert all(r == results[0] for r in results), f"ranks loaded different checkpoints: {results}"
    assert results[0][:3] == (6, 6, 2)


# ------------------------------------------------------- 9: checksums


def _case_load(ckpt, verify=True):
    model, optimizer, scheduler = _build(2, fsdp=True, hidden_size=HIDDEN)
    return load_checkpoint(model, optimizer, scheduler, ckpt, verify=verify)["iteration"]


@pytest.mark.slow  # a pool case on the 4-rank run above
def test_bit_flip_in_a_shard_fails_on_every_rank(pools, two_checkpoints, tmp_path):
    ckpt = str(tmp_path / "copy")
    shutil.copytree(two_checkpoints, ckpt)
    path = os.path.join(ckpt, "iter_0000006")
    # 4 KiB of flipped bits in the middle of the largest tensor's bytes: DCP itself notices nothing.
    storage = FileSystemReader(path).read_metadata().storage_data
    item = max(storage.values(), key=lambda info: info.length)
    shard = os.path.join(path, item.relative_path)
    with open(shard, "r+b") as f:
        f.seek(item.offset + item.length // 2 - 2048)
        block = f.read(4096)
        f.seek(-len(block), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in block))
    errors = pools(4).run_expecting_errors(_case_load, ckpt, timeout=TIMEOUT)
    for e in errors:
        assert e.type_name == "CheckpointError", f"rank {e.rank}: {e.type_name}: {e.message}"
        assert f"{shard}: checksum mismatch" in e.message.splitlines()[0], f"rank {e.rank}: {e.message}"
    # Only the check stands between the flip and training on damaged weights.
    assert pools(4).run(_case_load, ckpt, verify=False, timeout=TIMEOUT) == [6] * 4


def test_manifest_covers_every_file_and_is_written_before_publishing(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), model)
    real_replace, manifest_at_publish = os.replace, []
    def watching_replace(src, dst):
        if os.path.basename(str(dst)) == "iter_0000001":
            manifest_at_publish.append(os.path.isfile(os.path.join(src, checksums.MANIFEST_FILENAME)))
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", watching_replace)
    path = save_checkpoint(1, model, optimizer, None, str(tmp_path))
    assert manifest_at_publish == [True]
    with open(os.path.join(path, checksums.MANIFEST_FILENAME)) as f:
        listed = set(json.load(f)["files"])
    on_disk = {os.path.relpath(p, path) for p in glob.glob(os.path.join(path, "**", "*"), recursive=True)
               if os.path.isfile(p)} | {".metadata"}
    assert listed == on_disk - {checksums.MANIFEST_FILENAME}
    # DCP's metadata is checked too, and a checkpoint without a manifest is named.
    with open(os.path.join(path, ".metadata"), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(CheckpointError, match=r"\.metadata: checksum mismatch"):
        load_checkpoint(model, optimizer, None, str(tmp_path))
    os.remove(os.path.join(path, checksums.MANIFEST_FILENAME))
    with pytest.raises(CheckpointError, match="has no checksums.json.*--no-verify-checkpoint"):
        load_checkpoint(model, optimizer, None, str(tmp_path))


# ------------------------------------------------------- 10: --exit-on-missing-checkpoint


def _case_missing_load_dir(root, how):
    path = os.path.join(root, how)

    def make_it():
        if how == "empty":
            os.makedirs(path, exist_ok=True)
        elif how == "file":
            open(path, "w").close()
    on_rank_zero(make_it)
    model = nn.Linear(2, 2)
    fresh = load_checkpoint(model, None, None, path)
    assert fresh["iteration"] == 0 and fresh["path"] is None and path in fresh["missing"], fresh
    load_checkpoint(model, None, None, path, exit_on_missing_checkpoint=True)


@pytest.mark.parametrize("how,reason", [
    ("missing", "does not exist"),
    ("empty", "latest_checkpointed_iteration.txt not found"),
    ("file", "is a file, not a checkpoint directory"),
])
def test_exit_on_missing_checkpoint(pools, tmp_path, how, reason):
    errors = pools(2).run_expecting_errors(_case_missing_load_dir, str(tmp_path), how, timeout=TIMEOUT)
    for e in errors:
        assert e.type_name == "CheckpointError", f"rank {e.rank}: {e.type_name}: {e.message}"
        assert reason in e.message and "--exit-on-missing-checkpoint" in e.message, e.message
