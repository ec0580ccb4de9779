"""DCP checkpoints: resume, reshard across layouts, crash safety, clear errors, export."""

import glob
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from helpers import full_params, make_config, on_rank_zero, setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.dist_checkpointing import publish, torch_dcp
from megatron_fsdp.training import checkpointing
from megatron_fsdp.training.checkpointing import (CheckpointError, load_checkpoint, read_latest_iteration,
                                                  save_checkpoint)
from megatron_fsdp.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.optimizer_param_scheduler import OptimizerParamScheduler

TRACKER = checkpointing.TRACKER_FILENAME
TOTAL_STEPS = 6
SAVE_AT = 3
GLOBAL_BATCH = 4
SEQ = 16


def _build(tp, fsdp, hidden_size=32, swiglu=False):
    setup_parallel(tp)
    cfg = make_config(hidden_size=hidden_size, sequence_parallel=tp > 1, gated_linear_unit=swiglu,
                      activation_func=F.silu if swiglu else F.gelu)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=SEQ, position_embedding_type="rope")
    if fsdp:
        model = TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(), model)
    # eps 1e-5: see test_fsdp.ADAM (the key bias has a pure-noise gradient).
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, adam_eps=1e-5, clip_grad=1.0), model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                        lr_decay_steps=TOTAL_STEPS, lr_decay_style="cosine",
                                        start_wd=0.01, end_wd=0.01)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, first, last):
    dp = parallel_state.get_data_parallel_world_size()
    rows = slice(parallel_state.get_data_parallel_rank() * GLOBAL_BATCH // dp,
                 (parallel_state.get_data_parallel_rank() + 1) * GLOBAL_BATCH // dp)
    losses = []
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, 64, (GLOBAL_BATCH, SEQ + 1), generator=g)
        tokens, labels = ids[rows, :-1], ids[rows, 1:]
        loss = model(tokens, None, None, labels=labels).mean()
        loss.backward()
        if isinstance(model, TorchFullyShardedDataParallel):
            model.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        reported = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
        losses.append(reported.item() / dp)
    return losses


def _case_train_with_checkpoint(ckpt):
    # SwiGLU: fc1's [gate_r; up_r] rows reshard through the checkpoint's full [gate; up] layout.
    model, optimizer, scheduler = _build(2, fsdp=True, swiglu=True)
    losses = _train(model, optimizer, scheduler, 1, SAVE_AT)
    path = save_checkpoint(SAVE_AT, model, optimizer, scheduler, ckpt, extra_state={"note": "mid-run"})
    assert path == os.path.join(ckpt, "iter_0000003") and read_latest_iteration(ckpt) == SAVE_AT
    losses += _train(model, optimizer, scheduler, SAVE_AT + 1, TOTAL_STEPS)
    return losses


def _case_resume(ckpt, tp, fsdp):
    model, optimizer, scheduler = _build(tp, fsdp, swiglu=True)
    loaded = load_checkpoint(model, optimizer, scheduler, ckpt)
    assert loaded["iteration"] == SAVE_AT and loaded["extra_state"] == {"note": "mid-run"}
    assert scheduler.num_steps == SAVE_AT
    return loaded["rng_restored"], _train(model, optimizer, scheduler, SAVE_AT + 1, TOTAL_STEPS)


@pytest.fixture(scope="module")
def trained_checkpoint(pools, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    losses = pools(4).run(_case_train_with_checkpoint, ckpt)[0]
    return ckpt, losses


@pytest.mark.parametrize("world_size,tp,fsdp", [
    pytest.param(4, 2, True, marks=pytest.mark.slow),    # the saved layout: bit-identical continuation
    (2, 1, True),    # TP=1 x DP=2
    pytest.param(4, 4, True, marks=pytest.mark.slow),    # TP=4 x DP=1
    (1, 1, False),   # one process, no FSDP
])
def test_resume_matches_uninterrupted_run(pools, trained_checkpoint, world_size, tp, fsdp):
    ckpt, reference = trained_checkpoint
    rng_restored, losses = pools(world_size).run(_case_resume, ckpt, tp, fsdp)[0]
    expected = torch.tensor(reference[SAVE_AT:])
    if (world_size, tp) == (4, 2):
        assert rng_restored
        assert torch.equal(torch.tensor(losses), expected), f"{losses} != {reference[SAVE_AT:]}"
    else:
        assert not rng_restored, "RNG states belong to the saved layout only"
        torch.testing.assert_close(torch.tensor(losses), expected, rtol=1e-4, atol=1e-5)


def _case_crash_safety(ckpt):
    model, optimizer, scheduler = _build(2, fsdp=True)
    _train(model, optimizer, scheduler, 1, 1)
    save_checkpoint(1, model, optimizer, scheduler, ckpt)
    expected = full_params(model.module)
    _train(model, optimizer, scheduler, 2, 2)

    # Rank 1 fails to write: every rank reports which rank and why, nothing is published.
    real_save = torch.save
    def failing_save(obj, f, *args, **kwargs):
        if dist.get_rank() == 1:
            raise OSError("disk full (injected)")
        return real_save(obj, f, *args, **kwargs)
    torch.save = failing_save
    try:
        with pytest.raises(CheckpointError, match="the previous checkpoint is kept") as failure:
            save_checkpoint(2, model, optimizer, scheduler, ckpt)
    finally:
        torch.save = real_save
    assert "rank 1: OSError: disk full (injected)" in str(failure.value), str(failure.value)
    dist.barrier()
    assert read_latest_iteration(ckpt) == 1
    assert not os.path.exists(os.path.join(ckpt, "iter_0000002"))
    leftovers = glob.glob(os.path.join(ckpt, "*.tmp-*"))
    assert not leftovers, f"the failed save left {leftovers} behind"
    dist.barrier()  # every rank has looked before rank 0 fakes a killed save below

    # A process killed mid-save leaves only a temporary directory: still ignored.
    def fake_a_killed_save():
        partial = os.path.join(ckpt, "iter_0000002.tmp-killed")
        os.makedirs(partial)
        open(os.path.join(partial, "__0_0.distcp"), "wb").write(b"\0" * 10)
    on_rank_zero(fake_a_killed_save)
    assert load_checkpoint(model, optimizer, scheduler, ckpt)["iteration"] == 1
    got = full_params(model.module)
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{name} not restored"

    # The next save (rank 0 alone) removes what the killed save left.
    save_checkpoint(3, model, optimizer, scheduler, ckpt)
    assert not os.path.exists(os.path.join(ckpt, "iter_0000002.tmp-killed"))
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "iter_0000003", TRACKER]


@pytest.mark.slow  # a pool case
def test_interrupted_save_keeps_previous_checkpoint(pools, tmp_path):
    pools(4).run(_case_crash_safety, str(tmp_path))


def _case_load_error(ckpt, case):
    if case == "mismatched_model":
        model, optimizer, scheduler = _build(2, fsdp=True, hidden_size=48, swiglu=True)
    else:
        model, optimizer, scheduler = _build(2, fsdp=True, swiglu=True)
    load_checkpoint(model, optimizer, scheduler, ckpt, verify=case != "truncated_unverified")


def _case_damage(ckpt, how):
    def damage():
        path = os.path.join(ckpt, "iter_0000003")
        if how == "truncate":
            shard = sorted(glob.glob(os.path.join(path, "*.distcp")))[0]
            size = os.path.getsize(shard)
            with open(shard, "r+b") as f:
                f.truncate(size // 2)
        elif how == "tracker":
            open(os.path.join(ckpt, TRACKER), "w").write("7\n")
    on_rank_zero(damage)


@pytest.mark.parametrize("case,match", [
    ("mismatched_model", "does not fit the model"),
    ("truncated", "is corrupt: a file differs from what was saved"),
    ("truncated_unverified", "is incomplete or corrupt"),
    ("tracker_to_missing", "iter_0000007 is missing or incomplete"),
])
def test_bad_checkpoints_raise_clear_errors_on_every_rank(pools, trained_checkpoint, tmp_path, case, match):
    ckpt, _ = trained_checkpoint
    pool = pools(4)
    if case.startswith("truncated") or case == "tracker_to_missing":
        copy = str(tmp_path / "copy")
        import shutil
        shutil.copytree(ckpt, copy)
        ckpt = copy
        pool.run(_case_damage, ckpt, "tracker" if case == "tracker_to_missing" else "truncate")
    errors = pool.run_expecting_errors(_case_load_error, ckpt, case)
    for e in errors:
        assert e.type_name == "CheckpointError" and match in e.message, f"rank {e.rank}: {e.type_name}: {e.message}"
    if case == "mismatched_model":
        assert "checkpoint has shape [64, 32], model has [64, 48]" in errors[0].message
    if case == "truncated":  # the checksum check names the file
        # in the message's first line: the one a job's one-line error shows
        assert all(re.search(r"__\d_\d\.distcp: \d+ bytes, \d+ were written", e.message.splitlines()[0])
                   for e in errors), errors[0].message
    if case == "truncated_unverified":  # DCP's per-rank failures, one line each
        assert all(re.search(r"rank \d: \w+(Error|Exception)", e.message) for e in errors), errors[0].message


def _case_missing_state(ckpt):
    model, optimizer, scheduler = _build(1, fsdp=True)
    save_checkpoint(1, model, None, None, ckpt)  # Megatron's --no-save-optim
    path = os.path.join(ckpt, "iter_0000001")
    real_load, tensor_loads = torch_dcp.dcp.load, []

    def counting_load(state, *args, **kwargs):
        # The non-tensor entries are read by each rank alone (no_dist); the tensors collectively.
        if not kwargs.get("no_dist"):
            tensor_loads.append(sorted(state))
        return real_load(state, *args, **kwargs)

    torch_dcp.dcp.load = counting_load
    real_rng_key = checkpointing._rng_key
    try:
        with pytest.raises(CheckpointError, match=re.escape(path) + " holds no optimizer state.*--no-load-optim"):
            load_checkpoint(model, optimizer, scheduler, ckpt)
        with pytest.raises(CheckpointError, match="no learning-rate scheduler state.*--no-load-optim"):
            load_checkpoint(model, None, scheduler, ckpt)
        assert not tensor_loads, "the checks must come before DCP reads a tensor"
        assert load_checkpoint(model, optimizer, scheduler, ckpt, load_optim=False)["rng_restored"]
        assert tensor_loads == [["model"]]
        # A checkpoint without rank 1's RNG entry (rank 1 looks for another rank's name).
        if dist.get_rank() == 1:
            checkpointing._rng_key = lambda rank: "rank_00099"
        # Every rank names the rank without RNG state, before any tensor is read.
        with pytest.raises(CheckpointError, match="rank 1: .*has no RNG state for rank 1.*--no-load-rng"):
            load_checkpoint(model, optimizer, scheduler, ckpt, load_optim=False)
        assert len(tensor_loads) == 1
        assert not load_checkpoint(model, None, None, ckpt, load_rng=False)["rng_restored"]
    finally:
        torch_dcp.dcp.load = real_load
        checkpointing._rng_key = real_rng_key


def test_missing_optimizer_scheduler_or_rng_state_is_named_before_loading(pools, tmp_path):
    pools(2).run(_case_missing_state, str(tmp_path))


def _case_export(path):
    model, optimizer, scheduler = _build(2, fsdp=True, swiglu=True)
    _train(model, optimizer, scheduler, 1, 1)
    checkpointing.export_safetensors(model, path)
    weights = full_params(model.module)  # a collective: every rank gathers
    return weights if dist.get_rank() == 0 else None


def test_export_safetensors_holds_full_weights(pools, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    path = str(tmp_path / "model.safetensors")
    expected = pools(4).run(_case_export, path)[0]
    loaded = safetensors.load_file(path)
    assert loaded.keys() == expected.keys()
    fc1 = [n for n in expected if ".mlp.linear_fc1." in n]
    assert len(fc1) == 4  # weight and bias of two layers
    for name, tensor in expected.items():  # fc1: [gate; up] (full_params), not the TP=2 ranks' blocks
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], tensor), name
    assert not glob.glob(str(tmp_path / "*.tmp-*"))


# ------------------------------------------------------- one process: the file protocol

single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tiny(seed=0, bf16=False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    config = OptimizerConfig(lr=1e-3, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    if bf16:
        model = model.to(torch.bfloat16)
    return model, get_megatron_optimizer(config, model)


def _step(model, optimizer):
    model(torch.ones(2, 4, dtype=next(model.parameters()).dtype)).float().square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _loaded_weight(ckpt, iteration=None):
    model, optimizer = _tiny(seed=1)
    load_checkpoint(model, optimizer, None, ckpt, iteration=iteration, load_rng=False)
    return model[0].weight.detach().clone()


@single_process
def test_resave_keeps_a_loadable_checkpoint_at_every_moment(tmp_path, monkeypatch):
    ckpt = str(tmp_path)
    model, optimizer = _tiny()
    save_checkpoint(1, model, optimizer, None, ckpt)
    first = model[0].weight.detach().clone()
    _step(model, optimizer)
    second = model[0].weight.detach().clone()

    real_replace, seen = os.replace, []
    def checking_replace(src, dst):
        renames_iteration = os.path.basename(str(src)).startswith("iter_0000001")
        if renames_iteration:
            seen.append(_loaded_weight(ckpt))
        real_replace(src, dst)
        if renames_iteration:
            seen.append(_loaded_weight(ckpt))
    monkeypatch.setattr(checkpointing.os, "replace", checking_replace)
    save_checkpoint(1, model, optimizer, None, ckpt)
    assert len(seen) == 4 and torch.equal(seen[0], first) and torch.equal(seen[-1], second)
    assert all(torch.equal(w, first) or torch.equal(w, second) for w in seen)
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", TRACKER]

    # Killed between the two renames: the set-aside copy is what loads.
    class Killed(BaseException):
        pass
    def killed_replace(src, dst):
        if ".tmp-" in os.path.basename(str(src)) and os.path.basename(str(dst)) == "iter_0000001":
            raise Killed
        real_replace(src, dst)
    _step(model, optimizer)
    monkeypatch.setattr(checkpointing.os, "replace", killed_replace)
    with pytest.raises(Killed):
        save_checkpoint(1, model, optimizer, None, ckpt)
    monkeypatch.setattr(checkpointing.os, "replace", real_replace)
    assert not os.path.exists(os.path.join(ckpt, "iter_0000001"))
    assert torch.equal(_loaded_weight(ckpt), second)

    # A restarted run's first save puts the set-aside copy back and removes
    # what earlier runs left, but not a save of its own in progress.
    monkeypatch.setattr(publish, "_RUN_ID", "a1ater0n")
    in_progress = "iter_0000009.tmp-a1ater0n-0"
    for name in ("iter_0000009.tmp-0badc0de-1", "iter_0000009.tmp-killed", in_progress):
        os.makedirs(os.path.join(ckpt, name))
    save_checkpoint(2, model, optimizer, None, ckpt)
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "iter_0000002", in_progress, TRACKER]
    assert torch.equal(_loaded_weight(ckpt, iteration=1), second)


@single_process
def test_renames_and_tracker_are_fsynced(tmp_path, monkeypatch):
    ckpt = str(tmp_path)
    events = []
    real_replace, real_fsync = os.replace, os.fsync
    def recording_replace(src, dst):
        real_replace(src, dst)
        events.append(("replace", os.path.basename(str(dst))))
    def recording_fsync(fd):
        real_fsync(fd)
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
    monkeypatch.setattr(checkpointing.os, "replace", recording_replace)
    monkeypatch.setattr(checkpointing.os, "fsync", recording_fsync)
    model, optimizer = _tiny()
    save_checkpoint(1, model, optimizer, None, ckpt)
    root = os.path.realpath(ckpt)
    renamed, tracked = events.index(("replace", "iter_0000001")), events.index(("replace", TRACKER))
    for name in ("__0_0.distcp", ".metadata"):  # DCP syncs its metadata as .metadata.tmp, then renames it
        assert any(kind == "fsync" and path.endswith((name, f"{name}.tmp")) for kind, path in events[:renamed]), (
            f"{name} was not fsynced before the rename")
    # The checkpoint's rename is durable before the tracker names it, and the tracker after.
    assert ("fsync", root) in events[renamed + 1:tracked], "the directory was not fsynced after the rename"
    assert ("fsync", root) in events[tracked + 1:], "the directory was not fsynced after the tracker's rename"


@single_process
def test_bf16_main_params_round_trip(tmp_path):
    ckpt = str(tmp_path)
    model, optimizer = _tiny(bf16=True)
    for _ in range(2):
        _step(model, optimizer)
    save_checkpoint(2, model, optimizer, None, ckpt)
    mains = {n: t.clone() for n, t in optimizer.main_params_state_dict(model).items()}
    assert any(not torch.equal(m, m.bfloat16().float()) for m in mains.values()), "main params must be finer than bf16"

    restored, restored_optimizer = _tiny(seed=1, bf16=True)
    load_checkpoint(restored, restored_optimizer, None, ckpt, load_rng=False)
    for name, value in restored_optimizer.main_params_state_dict(restored).items():
        assert torch.equal(value, mains[name]), f"{name}: the fp32 main param must come back exactly"
    saved_state = optimizer.optimizer.state_dict()["state"]
    for index, value in restored_optimizer.optimizer.state_dict()["state"].items():
        assert value["exp_avg"].dtype == torch.float32 and torch.equal(value["exp_avg"], saved_state[index]["exp_avg"])

    # Without optimizer state (--no-load-optim), the main params follow the loaded model.
    fresh, fresh_optimizer = _tiny(seed=1, bf16=True)
    load_checkpoint(fresh, fresh_optimizer, None, ckpt, load_optim=False, load_rng=False)
    for name, value in fresh_optimizer.main_params_state_dict(fresh).items():
        assert torch.equal(value, dict(fresh.named_parameters())[name].detach().float()), name
