"""What a profiled run leaves, read back: the trace of tests/test_profiling.py's CPU run, and all of
scripts/gpu_check.sh's GPU run (its `profiling` step):

    python tests/profiling_outputs.py DIR LOG

DIR holds traces/ (--profile-dir), snapshot.pickle (--memory-snapshot-path) and the snapshot of the
out-of-memory error rank 0 was made to hit before iteration 5; LOG is that run's output. Prints one
`[gpu_check]` line, or fails with the first thing missing."""

from __future__ import annotations

import glob
import json
import os
import pickle
import sys


def trace_events(directory: str) -> tuple[list[str], list[dict]]:
    """The files in a trace directory, and the events of rank 0's trace."""
    files = sorted(glob.glob(os.path.join(directory, "*")))
    ours = [f for f in files if os.path.basename(f).startswith("rank0.") and f.endswith(".pt.trace.json")]
    assert len(ours) == 1, files
    with open(ours[0]) as f:
        return files, json.load(f)["traceEvents"]


def profiler_steps(events: list[dict]) -> list[str]:
    return sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})


def check_gpu_run(directory: str, log: str) -> str:
    from torch.cuda import _memory_viz  # torch's own reader of memory snapshots

    _, events = trace_events(os.path.join(directory, "traces"))
    assert profiler_steps(events) == ["ProfilerStep#2", "ProfilerStep#3"], profiler_steps(events)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert kernels, "no CUDA kernel in the trace"
    oom = os.path.join(directory, "oom_rank-0_snapshot.pickle")
    assert f"OutOfMemoryError: memory snapshot at the error written to {oom}: " in log, log[-3000:]
    for name in ("snapshot.pickle", "oom_rank-0_snapshot.pickle"):
        with open(os.path.join(directory, name), "rb") as f:
            snapshot = pickle.load(f)
        assert snapshot["segments"] and _memory_viz.trace_plot(snapshot), name
    actions = {e["action"] for trace in snapshot["device_traces"] for e in trace}
    assert "oom" in actions, f"no out-of-memory event in {oom}: {sorted(actions)}"
    return f"[gpu_check] trace of {len(kernels)} CUDA kernels in ProfilerStep#2-3; memory snapshots of the window " \
           "and of the out-of-memory error load in memory_viz"


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        print(check_gpu_run(sys.argv[1], f.read()))
