"""Megatron-LM's profiling flags (megatron_fsdp/training/profiling.py): the README's profiled run
against the same run unprofiled (in the worker pool), the flags' one-line errors, and the parts
a CPU has no device for (Nsight Systems' marks, the CUDA memory history) in this process, the
out-of-memory snapshot on a stand-in for CUDA's. The Flight Recorder trace of a timeout is the
stuck-rank test's (tests/test_training_faults.py); the GPU halves are scripts/gpu_check.sh's
`profiling` step."""

import os
import pickle
import re
import shlex
from argparse import Namespace
from unittest import mock

import pytest
import torch

from megatron_fsdp import _torch_compat
from megatron_fsdp.training import profiling
from pretrain_in_pool import pretrain_gpt_job
from profiling_outputs import profiler_steps, trace_events

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = re.compile(r"iteration\s+(\d+)/.*\| lm loss: ([\d.E+-]+) \|")
PROFILING_FLAGS = {"--profile": 0, "--use-pytorch-profiler": 0, "--profile-step-start": 1, "--profile-step-end": 1,
                   "--profile-dir": 1}


def readme_command() -> tuple[int, list[str]]:
    """The README's "Profiling" command: (processes, pretrain_gpt.py's flags)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Profiling", 1)[1]
    words = shlex.split(re.search(r"```bash\n(.*?)```", section, flags=re.S)[1].replace("\\\n", " "))
    assert words[:2] == ["torchrun", "--nproc-per-node"], words
    return int(words[2]), words[words.index("examples/pretrain_gpt.py") + 1:]


def _job(pools, nproc: int, flags: list[str]) -> str:
    outcomes = pools(nproc).run(pretrain_gpt_job, flags, timeout=400)
    out = "".join(text for _, text in outcomes)
    assert [code for code, _ in outcomes] == [0] * nproc, out[-3000:]
    return out


def _without_profiling(flags: list[str]) -> list[str]:
    kept, skip = [], 0
    for word in flags:
        if skip:
            skip -= 1
        elif word in PROFILING_FLAGS:
            skip = PROFILING_FLAGS[word]
        else:
            kept.append(word)
    return kept


def test_the_readmes_profiled_run_traces_its_iterations_on_rank_zero_and_trains_as_unprofiled(tmp_path, pools):
    """The README's command as written (the trace directory moved into tmp_path), on the pool's ranks:
    rank 0 alone writes one trace, of ProfilerStep#3 and #4 only, with the operators, FSDP2's
    all-gather and reduce-scatter and the step's phases in it; the log names the file; the losses
    are the unprofiled run's, digit for digit."""
    nproc, flags = readme_command()
    start, end = (int(flags[flags.index(f) + 1]) for f in ("--profile-step-start", "--profile-step-end"))
    traces = tmp_path / "profile"
    flags[flags.index("--profile-dir") + 1] = str(traces)
    profiled = _job(pools, nproc, flags)
    plain = _job(pools, nproc, _without_profiling(flags))

    losses = [{int(m[1]): m[2] for m in map(LOSS.search, out.splitlines()) if m} for out in (profiled, plain)]
    assert sorted(losses[0]) == list(range(1, 7)) and losses[0] == losses[1], losses
    files, events = trace_events(str(traces))
    assert len(files) == 1, files   # rank 0's alone, nothing half-written beside it
    assert re.fullmatch(r"rank0\.\d+\.pt\.trace\.json", os.path.basename(files[0])), files
    assert f"> [rank 0] torch profiler trace of iterations {start}-{end - 1} written to {files[0]}" in profiled
    assert profiler_steps(events) == [f"ProfilerStep#{i}" for i in range(start, end)]
    names = {event.get("name", "") for event in events}
    assert {"aten::mm", "aten::addmm"} & names and len({n for n in names if n.startswith("aten::")}) > 30
    assert set(profiling.PHASES) <= names, sorted(names)
    assert {"FSDP::all_gather", "FSDP::post_backward_reduce"} <= names


def _parse(*flags, world_size=2):
    from megatron_fsdp.training.arguments import parse_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--train-iters", "4"]
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world_size), "RANK": "0"}):
        return parse_args([*base, *flags])


@pytest.mark.parametrize("flags, message", [
    (["--profile-step-start", "5", "--profile-step-end", "5"],
     "--profile-step-end (5) must be greater than --profile-step-start (5): the profiled iterations are start..end-1"),
    (["--profile-step-start", "-1"], "--profile-step-start must be >= 0, got -1"),
    (["--profile", "--profile-ranks", "0", "-1"], "--profile-ranks: -1 is not a rank of this job (0..1)"),
    (["--profile", "--profile-ranks", "2"], "--profile-ranks: 2 is not a rank of this job (0..1)"),
    (["--use-pytorch-profiler", "--profile-dir", "x"], "--use-pytorch-profiler needs --profile"),
    (["--profile", "--use-pytorch-profiler"], "--use-pytorch-profiler writes its traces into --tensorboard-dir (as "
                                              "Megatron-LM) or --profile-dir: give one"),
    (["--profile", "--pytorch-profiler-collect-callstack"], "--pytorch-profiler-collect-callstack needs "
                                                            "--use-pytorch-profiler"),
    (["--pytorch-profiler-collect-shapes"], "--pytorch-profiler-collect-shapes needs --profile"),
    (["--profile", "--profile-dir", "x"], "--profile-dir needs --use-pytorch-profiler"),
    (["--flight-recorder-buffer-size", "-5"], "--flight-recorder-buffer-size must be >= 0, got -5"),
])
def test_bad_profiling_flags_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(*flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"error: {message}"), err


def test_megatrons_defaults():
    args = _parse()
    assert (args.profile, args.use_pytorch_profiler, args.profile_step_start, args.profile_step_end,
            args.profile_ranks, args.record_memory_history, args.memory_snapshot_path) == (
        False, False, 10, 12, [0], False, "snapshot.pickle")


@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")  # --profile-step-start 0, as torch says
@pytest.mark.parametrize("start, end, done", [(10, 12, 0), (3, 5, 0), (1, 3, 0), (0, 2, 0), (3, 5, 2), (3, 6, 4)])
def test_the_schedule_records_iterations_start_to_end_minus_one_after_one_warm_up(start, end, done):
    """Profiler step s (the s-th prof.step() of a run that starts after `done` iterations) is
    iteration done + s; Megatron-LM's schedule warms up on the iteration before the window."""
    from torch.profiler import ProfilerAction

    schedule = profiling.profiler_schedule(start, end, done)
    actions = {done + s: schedule(s) for s in range(20)}
    recording = {ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE}
    assert sorted(i for i, a in actions.items() if a in recording) == [i for i in range(start, end) if i >= done]
    assert actions[end - 1] == ProfilerAction.RECORD_AND_SAVE
    if start > done:
        assert actions[start - 1] == (ProfilerAction.WARMUP if start > 0 else ProfilerAction.NONE)


def _args(**overrides) -> Namespace:
    flags = dict(profile=False, use_pytorch_profiler=False, profile_step_start=2, profile_step_end=4, profile_ranks=[0],
                 pytorch_profiler_collect_shapes=False, pytorch_profiler_collect_callstack=False, profile_dir=None,
                 tensorboard_dir=None, record_memory_history=False, memory_snapshot_path="snapshot.pickle",
                 train_iters=6)
    return Namespace(**{**flags, **overrides})


class _Config:
    timers = None


def test_a_cpu_run_says_once_that_it_has_nothing_to_mark_or_record(capsys):
    with profiling.StepProfiler(_args(profile=True, record_memory_history=True)) as profiler:
        config = _Config()
        profiler.begin(config, 0)
        for iteration in range(1, 7):
            profiler.step_begin(iteration)
            assert config.timers is None
            profiler.step_end(iteration)
        profiler.end()
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "> --profile: nothing to mark for Nsight Systems on a CPU run (cudaProfilerStart/Stop and NVTX ranges are "
        "CUDA's); --use-pytorch-profiler traces a CPU run",
        "> --record-memory-history: torch records the CUDA caching allocator's history only, and this run is on the "
        "CPU: no memory snapshot (the memory line after the first iteration gives the peak resident memory)"], out


def test_the_phase_ranges_keep_a_timers_object_set_before():
    calls = []

    class Timer:
        def __init__(self, name):
            self.name = name

        def start(self, barrier=False):
            calls.append(("start", self.name, barrier))

        def stop(self, barrier=False):
            calls.append(("stop", self.name, barrier))

    ranges = profiling.PhaseRanges(lambda n: calls.append(("push", n)), lambda n: calls.append(("pop", n)),
                                   inner=lambda name, log_level=0: Timer(name))
    config = _Config()
    config.timers = ranges
    with profiling.timed(config, "optimizer"):
        calls.append("step")
    ranges("forward-backward", log_level=1).start(barrier=True)
    assert calls == [("push", "optimizer"), ("start", "optimizer", False), "step", ("stop", "optimizer", False),
                     ("pop", "optimizer"), ("push", "forward-backward"), ("start", "forward-backward", True)]
    with profiling.timed(_Config(), "optimizer"):   # no timers: nothing to time
        pass


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    """CUDA's allocator history on the CPU: a snapshot that says which calls came."""
    history = []
    monkeypatch.setattr(_torch_compat, "record_cuda_memory_history", lambda entries: history.append(("on", entries)))
    monkeypatch.setattr(_torch_compat, "stop_cuda_memory_history", lambda: history.append("off"))
    monkeypatch.setattr(_torch_compat, "cuda_memory_snapshot", lambda: {"segments": [], "history": list(history)})
    monkeypatch.setattr(profiling.parallel_state, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(profiling.parallel_state, "get_device_type", lambda: "cuda")
    return history


def test_an_out_of_memory_error_leaves_its_snapshot_and_names_it(tmp_path, fake_cuda_memory):
    path = str(tmp_path / "snaps" / "snapshot.pickle")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        with profiling.StepProfiler(_args(record_memory_history=True, memory_snapshot_path=path)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore advice")
    oom = str(tmp_path / "snaps" / "oom_rank-0_snapshot.pickle")
    assert str(raised.value) == (f"memory snapshot at the error written to {oom}: CUDA out of memory. Tried to "
                                 "allocate 2.00 GiB.\nmore advice")
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    with open(oom, "rb") as f:
        assert pickle.load(f) == {"segments": [], "history": [("on", profiling.MEMORY_HISTORY_ENTRIES)]}
    # The run's own snapshot (the window never closed: at the end), and the history stopped; nothing half-written.
    assert sorted(os.listdir(tmp_path / "snaps")) == ["oom_rank-0_snapshot.pickle", "snapshot.pickle"]
    assert fake_cuda_memory[-1] == "off"

    with pytest.raises(ValueError, match="^not memory$"):   # any other error passes unchanged
        with profiling.StepProfiler(_args(record_memory_history=True, memory_snapshot_path=path)):
            raise ValueError("not memory")


def test_the_memory_snapshot_is_written_when_the_window_closes(tmp_path, fake_cuda_memory, capsys):
    path = str(tmp_path / "snapshot.pickle")
    with profiling.StepProfiler(_args(record_memory_history=True, memory_snapshot_path=path)) as profiler:
        profiler.begin(_Config(), 0)
        for iteration in (1, 2, 3):
            profiler.step_begin(iteration)
            profiler.step_end(iteration)
            assert os.path.exists(path) == (iteration == 3)   # --profile-step-end 4: after iteration 3
    assert capsys.readouterr().out == f"> [rank 0] memory snapshot written to {path} (https://pytorch.org/memory_viz)\n"


def test_a_file_is_written_whole_or_not_at_all(tmp_path):
    from megatron_fsdp.training.utils import write_whole

    def fails(temporary):
        with open(temporary, "w") as f:
            f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(str(tmp_path / "trace.json"), fails)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("done, train_iters, traced, steps", [
    (0, 3, "2-3", ["ProfilerStep#2", "ProfilerStep#3"]),   # the run ends inside the window: cut there
    # Resumed inside it: torch counts the run's own steps, from the profiler's start before the first
    # iteration (step 0, already in the window: recorded, and empty).
    (3, 8, "4-5", ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]),
])
def test_a_window_cut_by_the_run_traces_what_it_reached(tmp_path, capsys, done, train_iters, traced, steps):
    """The loop's calls in this process (one rank, no group), window 2-5, a matmul per iteration."""
    args = _args(profile=True, use_pytorch_profiler=True, profile_step_end=6, profile_dir=str(tmp_path),
                 train_iters=train_iters)
    x = torch.randn(8, 8)
    with profiling.StepProfiler(args) as profiler:
        profiler.begin(_Config(), done)
        for iteration in range(done + 1, train_iters + 1):
            profiler.step_begin(iteration)
            x = x @ x / 8
            profiler.step_end(iteration)
        profiler.end()
    files, events = trace_events(str(tmp_path))
    assert profiler_steps(events) == steps and "aten::mm" in {e.get("name") for e in events}
    assert capsys.readouterr().out == f"> [rank 0] torch profiler trace of iterations {traced} written to {files[0]}\n"
