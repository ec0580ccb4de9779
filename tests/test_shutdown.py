"""Issue 12: finished runs exit 0; a failed run ends promptly with its own error.

Each case runs tests/shutdown_cycles.py, which forks whole 4-process jobs from
one interpreter (torch is imported once) and reports every process's exit.
"""

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _cycles(*args: str, timeout: float) -> list[dict]:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "shutdown_cycles.py"), *args],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"the driver failed: {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])["statuses"]


# The soak's length: 6 jobs (24 process exits) in CI's soak step. Without the shutdown barrier
# about one process in five aborted, which 24 exits miss with a chance of 0.8**24 (0.5%);
# MEGATRON_FSDP_SHUTDOWN_CYCLES=300 hunts a rarer abort. The default suite runs one finished job
# (4 exits: a missing barrier is still seen there more often than not) and one failing job, from
# one driver (one interpreter start for both).
CYCLES = int(os.environ.get("MEGATRON_FSDP_SHUTDOWN_CYCLES", "6"))


def _assert_every_process_exits_zero(statuses: list[dict], jobs: int) -> None:
    assert len(statuses) == 4 * jobs
    bad = [s for s in statuses if s["exit"] != 0 or "terminate called" in s["log"]]
    assert not bad, f"{len(bad)} of {4 * jobs} processes did not exit cleanly; first: {bad[0]}"


@pytest.fixture(scope="module")
def a_finished_job_then_a_failing_one() -> tuple[list[dict], list[dict]]:
    statuses = _cycles("--cycles", "2", "--world-size", "4", "--fail-rank", "1", "--fail-from-cycle", "1",
                       timeout=120)
    return [s for s in statuses if s["cycle"] == 0], [s for s in statuses if s["cycle"] == 1]


@pytest.mark.e2e
def test_a_finished_four_rank_job_exits_zero_on_every_rank(a_finished_job_then_a_failing_one):
    _assert_every_process_exits_zero(a_finished_job_then_a_failing_one[0], 1)


@pytest.mark.soak
def test_many_finished_four_rank_jobs_all_exit_zero():
    _assert_every_process_exits_zero(_cycles("--cycles", str(CYCLES), "--world-size", "4",
                                             timeout=30 + 10 * CYCLES), CYCLES)


@pytest.mark.e2e
def test_a_failing_rank_ends_the_job_promptly_with_its_own_error(a_finished_job_then_a_failing_one):
    statuses = a_finished_job_then_a_failing_one[1]
    by_rank = {s["rank"]: s for s in statuses}
    assert by_rank[1]["exit"] != 0
    assert "ValueError: injected failure on rank 1" in by_rank[1]["log"], by_rank[1]["log"]
    # The peers were waiting for rank 1 in a collective: they fail too, instead
    # of hanging until the 60 s process-group timeout.
    assert all(by_rank[r]["exit"] != 0 for r in (0, 2, 3)), statuses
    elapsed = statuses[0]["cycle_seconds"]
    assert elapsed < 50, f"the failed job took {elapsed:.0f} s to end"


def test_after_destroying_the_group_the_ranks_meet_on_the_store(monkeypatch):
    import threading

    import torch.distributed as dist

    from megatron_fsdp.training import initialize

    store = dist.HashStore()
    done = []
    ranks = [threading.Thread(target=lambda host=host: done.append(
        initialize._wait_until_every_rank_destroyed(store, 2, "a", last_to_leave=host))) for host in (True, False)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=5)
    assert len(done) == 2  # both left once both had arrived
    # The store's host (rank 0 without torchrun's agent) leaves only after every rank said it leaves.
    assert store.add("a/left", 0) == 2
    # A peer that never comes ends the wait after the bound, not the job; a missing store, at once.
    monkeypatch.setattr(initialize, "_DESTROY_WAIT_S", 0.2)
    start = time.monotonic()
    initialize._wait_until_every_rank_destroyed(store, 2, "b")
    initialize._wait_until_every_rank_destroyed(None, 2, "c")
    assert 0.2 <= time.monotonic() - start < 3
