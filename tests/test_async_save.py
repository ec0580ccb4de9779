"""Checkpoints that do not stop training (dist_checkpointing.manager, --async-save): the state
saved is the state at the call, whatever the steps after it change; the loop stalls only while
it is staged; a failed or killed background write keeps the previous checkpoint; a save makes no
collective of its own; a resume from an asynchronous save repeats the uninterrupted run."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_fsdp.dist_checkpointing import checksums, publish
from megatron_fsdp.dist_checkpointing.manager import CheckpointManager, set_checkpoint_manager
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training.checkpointing import (CheckpointError, checkpoint_states, load_checkpoint,
                                                  read_latest_iteration, save_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tiny(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    return model, get_megatron_optimizer(OptimizerConfig(lr=1e-2), model)


def _step(model, optimizer):
    model(torch.ones(4, 64)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _loaded(ckpt, iteration=None) -> dict:
    model, optimizer = _tiny(seed=1)
    load_checkpoint(model, optimizer, None, ckpt, iteration=iteration, load_rng=False)
    return _weights(model)


@contextlib.contextmanager
def slow_writes(seconds: float):
    """A slow file system: every file takes `seconds` before its first byte is written (in the
    writer's thread), so that what runs meanwhile runs before the bytes are taken."""
    real = checksums.ChecksumFileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode:
            time.sleep(seconds)
        with real(self, path, mode) as stream:
            yield stream

    checksums.ChecksumFileSystem.create_stream = create_stream
    try:
        yield
    finally:
        checksums.ChecksumFileSystem.create_stream = real


@contextlib.contextmanager
def manager_in_use(**kwargs):
    manager = CheckpointManager(**kwargs)
    previous = set_checkpoint_manager(manager)
    try:
        yield manager
    finally:
        set_checkpoint_manager(previous)
        manager.close()


def _optimizer_state(optimizer) -> dict:
    state = optimizer.optimizer.state_dict()
    return {"state": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for i, s in state["state"].items()},
            "lr": [group["lr"] for group in state["param_groups"]]}


@single_process
def test_an_async_save_holds_the_state_at_the_call_not_the_steps_during_its_write(tmp_path):
    ckpt = str(tmp_path)
    model, optimizer = _tiny()
    _step(model, optimizer)
    at_call, optimizer_at_call = _weights(model), _optimizer_state(optimizer)
    with manager_in_use(async_save=True) as manager, slow_writes(0.3):
        save_checkpoint(1, model, optimizer, None, ckpt)
        assert manager.pending is not None and read_latest_iteration(ckpt) is None  # not published yet
        for _ in range(3):  # the steps a real loop runs while the write waits for its first byte
            _step(model, optimizer)
        for group in optimizer.param_groups:
            group["lr"] = 0.5  # what a scheduler's step changes
        assert not manager.pending_done(), "the write ended before the steps: the test proves nothing"
        saved = manager.finalize(blocking=True)
    assert saved.iteration == 1 and saved.write_s >= 0.3 and read_latest_iteration(ckpt) == 1
    restored, restored_optimizer = _tiny(seed=1)
    load_checkpoint(restored, restored_optimizer, None, ckpt, load_rng=False)
    got = _weights(restored)
    for name, value in at_call.items():
        assert torch.equal(got[name], value), f"{name}: the async checkpoint is not the state at the call"
    loaded = _optimizer_state(restored_optimizer)
    assert loaded["lr"] == optimizer_at_call["lr"]
    for index, values in optimizer_at_call["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(loaded["state"][index][key]), torch.as_tensor(value)), (index, key)


def _tensor_files(ckpt, iteration) -> dict:
    import json
    with open(os.path.join(publish.checkpoint_dir(ckpt, iteration), checksums.MANIFEST_FILENAME)) as f:
        files = json.load(f)["files"]
    return {name: entry for name, entry in files.items() if name != ".metadata"}


@single_process
def test_an_async_save_stalls_the_loop_a_small_fraction_of_a_synchronous_one(tmp_path):
    model, optimizer = _tiny()
    _step(model, optimizer)
    with manager_in_use() as manager, slow_writes(0.5):
        sync = manager.save(1, checkpoint_states(1, model, optimizer), str(tmp_path / "sync")).blocking_s
        manager.save(1, checkpoint_states(1, model, optimizer), str(tmp_path / "async"), async_save=True)
        stall = manager.pending.blocking_s
        saved = manager.finalize(blocking=True)
    assert sync >= 0.5 and stall < 0.2 * sync, f"async stall {stall:.3f} s, sync {sync:.3f} s"
    assert saved.write_s >= 0.5
    assert _tensor_files(str(tmp_path / "sync"), 1) == _tensor_files(str(tmp_path / "async"), 1)


@single_process
def test_the_next_save_waits_for_the_pending_one(tmp_path):
    ckpt = str(tmp_path)
    model, optimizer = _tiny()
    with manager_in_use(async_save=True) as manager, slow_writes(0.1):
        save_checkpoint(1, model, optimizer, None, ckpt)
        first = _weights(model)
        _step(model, optimizer)
        save_checkpoint(2, model, optimizer, None, ckpt)
        assert manager.last_saved.iteration == 1 and read_latest_iteration(ckpt) == 1
        assert manager.finalize(blocking=True).iteration == 2
    assert read_latest_iteration(ckpt) == 2
    assert all(torch.equal(_loaded(ckpt, 1)[n], v) for n, v in first.items())


_KILLED_DURING_WRITE = textwrap.dedent("""
    import os, signal, sys, time, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, {tests!r})
    from test_async_save import _tiny, _step, slow_writes, manager_in_use
    from megatron_fsdp.dist_checkpointing import checksums
    from megatron_fsdp.training.checkpointing import save_checkpoint
    model, optimizer = _tiny()
    save_checkpoint(1, model, optimizer, None, {ckpt!r})
    _step(model, optimizer)
    real = checksums.ChecksumFileSystem.create_stream
    with manager_in_use(async_save=True):
        with slow_writes(30):  # the first file written, then killed while the write goes on
            save_checkpoint(2, model, optimizer, None, {ckpt!r})
            open({marker!r}, "w").close()
            time.sleep(60)
""")


@single_process
def test_kill_9_during_a_background_write_leaves_the_previous_checkpoint_the_latest(tmp_path):
    ckpt, marker = str(tmp_path / "ckpt"), str(tmp_path / "staged")
    script = _KILLED_DURING_WRITE.format(tests=os.path.join(ROOT, "tests"), ckpt=ckpt, marker=marker)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert proc.poll() is None, f"the saving process ended early (exit {proc.returncode})"
            assert time.monotonic() < deadline, "the async save was not staged within 60 s"
            time.sleep(0.05)
        time.sleep(0.3)  # the writer is inside its write
        assert any(".tmp-" in name for name in os.listdir(ckpt)), os.listdir(ckpt)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert read_latest_iteration(ckpt) == 1
    model, optimizer = _tiny()
    assert all(torch.equal(_loaded(ckpt)[n], v) for n, v in _weights(model).items())
    # The next run's first save removes what the killed write left.
    save_checkpoint(3, model, optimizer, None, ckpt)
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "iter_0000003", "latest_checkpointed_iteration.txt"]


# ------------------------------------------------------------------ across ranks (the worker pool)

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
                "gather_object", "scatter_object_list", "reduce_scatter", "all_to_all", "gather", "scatter")


def _case_a_save_makes_only_dcps_collectives(ckpt):
    model, optimizer = _tiny()
    _step(model, optimizer)
    with manager_in_use(async_save=False) as manager:
        manager.setup()  # the groups are made once, at start-up
        calls, real = [], {name: getattr(dist, name) for name in _COLLECTIVES}

        def counting(name):
            def collective(*args, **kwargs):
                calls.append((name, kwargs.get("group")))
                return real[name](*args, **kwargs)
            return collective

        for name in _COLLECTIVES:
            setattr(dist, name, counting(name))
        try:
            save_checkpoint(1, model, optimizer, None, ckpt)
        finally:
            for name, function in real.items():
                setattr(dist, name, function)
        assert calls, "DCP's own collectives were not seen: the count below proves nothing"
        others = [name for name, group in calls if group is not manager._save_group]
        assert not others, f"collectives of the save's own, not DCP's on the manager's group: {others}"
    return read_latest_iteration(ckpt)


def test_a_save_makes_no_collective_of_its_own(pools, tmp_path):
    assert pools(2).run(_case_a_save_makes_only_dcps_collectives, str(tmp_path)) == [1, 1]


def _case_a_failed_background_write(ckpt):
    model, optimizer = _tiny()
    save_checkpoint(1, model, optimizer, None, ckpt)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if dist.get_rank() == 1:
            raise OSError("disk full (injected)")
        return real_save(obj, f, *args, **kwargs)

    with manager_in_use(async_save=True) as manager:
        torch.save = failing_save  # the entries' bytes are written by torch.save, in the writer's thread
        try:
            save_checkpoint(2, model, optimizer, None, ckpt)
            with pytest.raises(CheckpointError, match="the previous checkpoint is kept") as failure:
                manager.finalize(blocking=True)
        finally:
            torch.save = real_save
    dist.barrier()
    assert "rank 1: OSError: disk full (injected)" in str(failure.value), str(failure.value)
    leftovers = [n for n in os.listdir(ckpt) if ".tmp-" in n]
    return read_latest_iteration(ckpt), leftovers


def test_a_failed_background_write_is_one_error_on_every_rank_and_keeps_the_previous(pools, tmp_path):
    assert pools(2).run(_case_a_failed_background_write, str(tmp_path)) == [(1, [])] * 2


# ------------------------------------------------------------------ a pretrain() job

@pytest.mark.slow  # pretrain() jobs in the worker pool
def test_a_resume_from_async_saves_repeats_the_uninterrupted_run_bit_for_bit(tmp_path, pools):
    from test_training import DROPOUT, LINE, _pretrain

    ckpt = str(tmp_path / "ckpt")
    run = [*DROPOUT, "--eval-interval", "2", "--eval-iters", "1"]
    first = _pretrain(pools, 2, *run, "--save", ckpt, "--save-interval", "3", "--async-save")
    out = first.stdout
    staged = out.index("> checkpoint at iteration 3 staged in")
    published = re.search(r"> saved checkpoint at iteration 3 to \S+ \(blocking [\d.]+ s, background write [\d.]+ s\)",
                          out)
    assert published and published.start() > staged, out[-3000:]
    assert re.search(r"> saved checkpoint at iteration 6 to .*background write", out), "the last save was not waited for"
    assert read_latest_iteration(ckpt) == 6
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3\n")
    resumed = _pretrain(pools, 2, *run, "--load", ckpt)
    losses = [{int(m[1]): m[6] for m in map(LINE.search, proc.stdout.splitlines()) if m} for proc in (first, resumed)]
    assert sorted(losses[1]) == [4, 5, 6] and losses[1] == {k: v for k, v in losses[0].items() if k > 3}


def _case_an_error_waits_for_the_pending_save(argv):
    from pretrain_with_faults import nan_fault_job

    with slow_writes(0.5):  # iteration 2's save is still being written when iteration 3 fails
        return nan_fault_job(argv, 1, 3)


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_an_error_during_a_background_write_publishes_it_before_the_job_ends(tmp_path, pools):
    """--async-save --save-interval 1: iteration 3's loss is NaN on rank 1 while iteration 2's checkpoint
    is written in the background. The job stops with its one-line error, after that checkpoint is
    published: it is the latest, complete, and nothing of iteration 3 was saved."""
    from test_training_faults import FLAGS, _tracker

    ckpt = str(tmp_path / "ckpt")
    outcomes = pools(2).run(_case_an_error_waits_for_the_pending_save,
                            [*FLAGS, "--train-iters", "6", "--save", ckpt, "--save-interval", "1", "--async-save"],
                            timeout=400)
    out = "".join(text for _, text in outcomes)
    assert [code for code, _ in outcomes] == [1, 1], out[-3000:]
    assert "> saved checkpoint at iteration 2" in out, out[-3000:]
    assert _tracker(ckpt) == "2" and not os.path.exists(os.path.join(ckpt, "iter_0000003"))
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]


def test_the_flags_are_megatrons(capsys):
    """--async-save needs --save (one line, exit code 2); --use-persistent-ckpt-worker, which Megatron-LM
    asks for with it, is accepted and implied."""
    from test_usage_errors import _parse

    args = _parse("--save", "ckpt", "--async-save", world_size=1)
    assert args.async_save and args.use_persistent_ckpt_worker
    assert _parse("--save", "ckpt", "--async-save", "--use-persistent-ckpt-worker", world_size=1).async_save
    assert not _parse("--save", "ckpt", world_size=1).async_save
    with pytest.raises(SystemExit) as exit_info:
        _parse("--async-save", world_size=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "--async-save needs --save" in err[0], err


@single_process
def test_a_save_that_waits_for_the_previous_one_says_when_that_one_was_published(tmp_path, capsys, monkeypatch):
    """The training loop's save while the previous checkpoint is still being written: that one is
    published first, and its 'saved' line is printed then, not lost."""
    from megatron_fsdp.training import training

    model, optimizer = _tiny()
    monkeypatch.setattr(training, "save_training_checkpoint", lambda args, iteration, *rest: save_checkpoint(
        iteration, model, optimizer, None, str(tmp_path)))
    with manager_in_use(async_save=True) as manager, slow_writes(0.2):
        training._save(None, 1, model, optimizer, None, 0.0, None)
        training._save(None, 2, model, optimizer, None, 0.0, None)
        out = capsys.readouterr().out
        assert re.search(r"> saved checkpoint at iteration 1 to \S+ \(blocking [\d.]+ s, background write", out), out
        assert re.search(r"> checkpoint at iteration 2 staged in [\d.]+ s after waiting [\d.]+ s for the previous", out)
        assert manager.finalize(blocking=True).iteration == 2


def _case_ranks_agree_on_a_save_one_of_them_saw_fail(ckpt):
    from concurrent.futures import Future

    model, optimizer = _tiny()
    with manager_in_use(async_save=True) as manager:
        save_checkpoint(1, model, optimizer, None, ckpt)
        if dist.get_rank() == 1:  # what DCP did not gather: this rank's own collective failed (a peer gone)
            real = manager._pending.future
            failed = Future()
            failed.set_exception(RuntimeError("Connection closed by peer (injected)"))
            manager._pending.future = failed
        with pytest.raises(CheckpointError) as failure:
            manager.finalize(blocking=True)
        if dist.get_rank() == 1:
            real.result()  # (the real write, for a clean end)
    return str(failure.value)


def test_every_rank_raises_when_one_saw_its_background_save_fail(pools, tmp_path):
    messages = pools(2).run(_case_ranks_agree_on_a_save_one_of_them_saw_fail, str(tmp_path))
    assert messages[0] == messages[1] and "failed on rank(s) [1]" in messages[0], messages
    assert "Connection closed by peer (injected)" in messages[0]
