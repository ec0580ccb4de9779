"""Where a step's time and memory go: Megatron-LM's profiling flags, for the training loop.

- `--profile --use-pytorch-profiler`: the torch profiler over iterations
  --profile-step-start..--profile-step-end - 1 (numbered as in the log line) on the
  --profile-ranks, with Megatron-LM's schedule (wait, one warm-up iteration, the active
  ones), CPU and CUDA activities; each profiled rank writes one trace in TensorBoard's
  format (`rank<R>.<ns>.pt.trace.json`) into --profile-dir or --tensorboard-dir when the
  window closes, and says where. ProfilerStep#N is the run's N-th iteration.
- `--profile` alone: the same iterations marked for Nsight Systems (`nsys profile
  --capture-range=cudaProfilerApi`): cudaProfilerStart/Stop around them, and NVTX ranges
  (`emit_nvtx`: every operator and every `record_function` range, FSDP2's
  `FSDP::all_gather` and `FSDP::post_backward_reduce` included). A CPU run has nothing to
  mark: it says so once.
- In the window, on a profiled rank, the step's phases are ranges in either profiler:
  Megatron's timer names (`forward-backward`, `forward-compute`, `backward-compute`,
  `all-grads-sync`, `optimizer`), through the timers seam Megatron-Core's schedule already
  calls (`config.timers`, see `PhaseRanges`).
- `--record-memory-history`: the CUDA caching allocator's history from start-up; the last
  rank writes a snapshot to --memory-snapshot-path when the window closes (or at the end of
  the run, if the window does not close in it), and a rank that runs out of memory writes
  `oom_rank-<R>_<name>` beside it, the error re-raised with that path in its first line
  (Megatron-LM's names). Open them at https://pytorch.org/memory_viz. A CPU run says once
  that there is nothing to record.

Every file is written whole or not at all (a temporary file renamed).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from typing import Optional

import torch
import torch.distributed as dist

from .. import _torch_compat, parallel_state
from ..utils import is_distributed
from .utils import write_whole

# Megatron-LM's and torchtitan's history length: alloc/free events kept before a snapshot.
MEMORY_HISTORY_ENTRIES = 100_000
PHASES = ("forward-backward", "forward-compute", "backward-compute", "all-grads-sync", "optimizer")


def write_memory_snapshot(path: str) -> str:
    snapshot = _torch_compat.cuda_memory_snapshot()

    def dump(temporary: str) -> None:
        with open(temporary, "wb") as f:
            pickle.dump(snapshot, f)

    return write_whole(path, dump)


def oom_snapshot_path(path: str, rank: int) -> str:
    """Megatron-LM's name for an out-of-memory snapshot, beside --memory-snapshot-path."""
    return os.path.join(os.path.dirname(path), f"oom_rank-{rank}_{os.path.basename(path)}")


def profiler_schedule(start: int, end: int, done: int):
    """Megatron-LM's schedule of iterations start..end-1, counted from the first iteration of the
    run (`done` iterations were trained before it: a resumed run still profiles the same iterations)."""
    # NOTE: profiler step s (the s-th prof.step() of this run) is iteration done + s.
    base = torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start,
                                   repeat=1)
    return lambda step: base(step + done)


class PhaseRanges:
    """Megatron's timers interface (`timers(name, log_level=...)` with `.start()` and `.stop()`), each
    timer a named range: `push(name)` and `pop(name)`. Set as `config.timers` in the window, so the
    ranges come from where Megatron-Core's schedule, finalize_model_grads and train_step already time
    their phases. A timers object set before (a user's) still runs, inside its range."""

    def __init__(self, push, pop, inner=None):
        self.push, self.pop, self.inner = push, pop, inner

    def __call__(self, name: str, log_level: int = 0):
        return _PhaseRange(self, name, self.inner(name, log_level=log_level) if self.inner else None)


class _PhaseRange:
    def __init__(self, ranges: PhaseRanges, name: str, inner):
        self.ranges, self.name, self.inner = ranges, name, inner

    def start(self, barrier: bool = False) -> None:
        self.ranges.push(self.name)
        if self.inner is not None:
            self.inner.start(barrier=barrier)

    def stop(self, barrier: bool = False) -> None:
        if self.inner is not None:
            self.inner.stop(barrier=barrier)
        self.ranges.pop(self.name)


@contextlib.contextmanager
def timed(config, name: str, log_level: int = 1):
    """Megatron's `timers(name).start()` ... `.stop()` around a block, when `config.timers` is set."""
    timers = getattr(config, "timers", None)
    timer = timers(name, log_level=log_level) if timers is not None else None
    if timer is not None:
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.stop()


class _Ranges:
    """The phases' ranges of one window: `record_function` scopes (the torch profiler's trace) or
    NVTX ranges (Nsight Systems). `close()` ends those an error left open."""

    def __init__(self, nvtx: bool):
        self.nvtx = nvtx
        self.open: list = []  # NOTE: ranges nest (the timers' phases do): the last opened closes first

    def push(self, name: str) -> None:
        if self.nvtx:
            torch.cuda.nvtx.range_push(name)
            self.open.append(name)
        else:
            scope = torch.profiler.record_function(name)
            scope.__enter__()
            self.open.append(scope)

    def pop(self, name: str = "") -> None:
        scope = self.open.pop()
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        else:
            scope.__exit__(None, None, None)

    def close(self) -> None:
        while self.open:
            self.pop()


class StepProfiler:
    """The run's profiling, from the flags: `with StepProfiler(args) as profiler:` around the job
    (memory history starts here, and an out-of-memory error leaves its snapshot), then
    `begin(config, done)` before the loop, `step_begin(n)` and `step_end(n)` around iteration n."""

    def __init__(self, args):
        self.args = args
        self.rank = dist.get_rank() if is_distributed() else 0
        self.last_rank = self.rank == (dist.get_world_size() - 1 if is_distributed() else 0)
        self.cuda = parallel_state.model_parallel_is_initialized() and parallel_state.get_device_type() == "cuda"
        self.window_start, self.window_end = args.profile_step_start, args.profile_step_end
        self.profiled = args.profile and self.rank in args.profile_ranks
        self.torch_profiler = None
        self.marking = None  # the emit_nvtx context while Nsight Systems' window is open
        self.config = self.saved_timers = self.ranges = None
        self.profiled_iterations: list[int] = []  # those of the window this run reached, on this rank
        self.memory = args.record_memory_history and self.cuda
        self.snapshot_written = False
        self._say_what_a_cpu_run_does_not_do()
        if self.memory:
            _torch_compat.record_cuda_memory_history(MEMORY_HISTORY_ENTRIES)

    def _say_what_a_cpu_run_does_not_do(self) -> None:
        if self.cuda or self.rank != 0:
            return
        if self.args.profile and not self.args.use_pytorch_profiler:
            print("> --profile: nothing to mark for Nsight Systems on a CPU run (cudaProfilerStart/Stop and NVTX "
                  "ranges are CUDA's); --use-pytorch-profiler traces a CPU run", flush=True)
        if self.args.record_memory_history:
            print("> --record-memory-history: torch records the CUDA caching allocator's history only, and this run "
                  "is on the CPU: no memory snapshot (the memory line after the first iteration gives the peak "
                  "resident memory)", flush=True)

    # ------------------------------------------------------------------ the loop's calls

    def begin(self, config, done: int) -> None:
        """Before the first iteration of this run (`done` iterations were trained before it)."""
        self.config = config
        last = min(self.window_end - 1, self.args.train_iters)
        if self.args.profile and self.rank == 0 and max(self.window_start, done + 1) > last:
            print(f"> --profile: iterations {self.window_start}-{self.window_end - 1} are not among this run's "
                  f"iterations {done + 1}-{self.args.train_iters}: nothing is profiled", flush=True)
        if self.profiled and self.args.use_pytorch_profiler:
            self.torch_profiler = self._build_torch_profiler(done)
            self.torch_profiler.start()

    def step_begin(self, iteration: int) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.step()  # as Megatron-LM: at the top of every iteration
        if self.profiled and self.window_start <= iteration < self.window_end:
            self.profiled_iterations.append(iteration)
            if self.config is not None and self.saved_timers is None:
                self._open_window()

    def step_end(self, iteration: int) -> None:
        if iteration == self.window_end - 1:
            self._close_window()

    def end(self) -> None:
        """The loop ended: a window still open closes, what it recorded is written."""
        self._close_window()

    def close(self) -> None:
        """The job ended (however): as end(), and the memory history stops."""
        self._close_window()
        if self.memory:
            _torch_compat.stop_cuda_memory_history()
            self.memory = False

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.close()
            return False
        oom = self.oom_error(exc)
        with contextlib.suppress(Exception):  # the job's own error is the one to report
            self.close()
        if oom is not None:
            raise oom from exc
        return False

    # ------------------------------------------------------------------ the window

    def _open_window(self) -> None:
        if not self.args.use_pytorch_profiler:
            if not self.cuda:
                return  # a CPU run: said once at start-up
            torch.cuda.profiler.start()  # cudaProfilerStart: nsys --capture-range=cudaProfilerApi starts here
            self.marking = torch.autograd.profiler.emit_nvtx(record_shapes=self.args.pytorch_profiler_collect_shapes)
            self.marking.__enter__()
            print(f"> [rank {self.rank}] --profile: iterations {self.window_start}-{self.window_end - 1} marked for "
                  "Nsight Systems (cudaProfilerStart/Stop, NVTX ranges)", flush=True)
        self.ranges = _Ranges(nvtx=not self.args.use_pytorch_profiler)
        self.saved_timers = (getattr(self.config, "timers", None),)
        self.config.timers = PhaseRanges(self.ranges.push, self.ranges.pop, inner=self.saved_timers[0])

    def _close_window(self) -> None:
        if self.saved_timers is not None:
            self.config.timers = self.saved_timers[0]
            self.saved_timers = None
            self.ranges.close()
        if self.marking is not None:
            self.marking.__exit__(None, None, None)
            self.marking = None
            torch.cuda.profiler.stop()
        if self.torch_profiler is not None:
            profiler, self.torch_profiler = self.torch_profiler, None
            profiler.stop()  # in the window: the trace is written now (_write_trace)
        if self.memory and self.last_rank and not self.snapshot_written:
            self.snapshot_written = True
            path = write_memory_snapshot(self.args.memory_snapshot_path)
            print(f"> [rank {self.rank}] memory snapshot written to {path} (https://pytorch.org/memory_viz)",
                  flush=True)

    def _build_torch_profiler(self, done: int):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=activities, schedule=profiler_schedule(self.window_start, self.window_end, done),
            on_trace_ready=self._write_trace, record_shapes=self.args.pytorch_profiler_collect_shapes,
            with_stack=self.args.pytorch_profiler_collect_callstack)

    def _write_trace(self, profiler) -> None:
        # tensorboard_trace_handler's file name, written whole (it writes in place).
        directory = self.args.profile_dir or self.args.tensorboard_dir
        path = os.path.join(directory, f"rank{self.rank}.{time.time_ns()}.pt.trace.json")
        write_whole(path, profiler.export_chrome_trace)
        seen = self.profiled_iterations
        what = f"iterations {seen[0]}-{seen[-1]}" if seen else "no iteration (the run ended before the window)"
        print(f"> [rank {self.rank}] torch profiler trace of {what} written to {path}", flush=True)

    # ------------------------------------------------------------------ out of memory

    def oom_error(self, exc: BaseException) -> Optional[BaseException]:
        """With --record-memory-history on CUDA, for an out-of-memory error: its snapshot written,
        and the error again with the snapshot's path in its first line; else None."""
        if not self.memory or not isinstance(exc, torch.OutOfMemoryError):
            return None
        try:
            path = write_memory_snapshot(oom_snapshot_path(self.args.memory_snapshot_path, self.rank))
        except Exception:  # (no room for it either): the error as it was
            return None
        first, _, rest = str(exc).partition("\n")
        return torch.OutOfMemoryError(f"memory snapshot at the error written to {path}: {first}"
                                      + (f"\n{rest}" if rest else ""))
