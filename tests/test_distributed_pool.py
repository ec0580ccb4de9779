"""The worker pool's own guarantees (tests/distributed_pool.py, tests/helpers.py): ranks forked
from the preloading server see the environment of their pool's start, and a failure on one rank
reaches every rank at once instead of leaving them waiting in a collective."""

import time

import torch.distributed as dist

from distributed_pool import GROUP_TIMEOUT, WorkerPool
from helpers import on_rank_zero


def _case_rank_zero_raises() -> None:
    def section():
        raise ValueError("only rank 0 saw this")
    on_rank_zero(section)


def _case_rank_zero_section(tag: str) -> list[str]:
    done = []
    on_rank_zero(done.append, tag)
    dist.barrier()
    return done


def test_a_rank_zero_section_runs_there_alone_and_its_error_reaches_every_rank_at_once(pools):
    pool = pools(4)
    assert pool.run(_case_rank_zero_section, "x") == [["x"], [], [], []]
    start = time.monotonic()
    errors = pool.run_expecting_errors(_case_rank_zero_raises)
    assert time.monotonic() - start < GROUP_TIMEOUT.total_seconds() / 3
    assert (errors[0].type_name, errors[0].message) == ("ValueError", "only rank 0 saw this")
    assert all(e.type_name == "RuntimeError" and "rank 0 failed in section: ValueError: only rank 0 saw this"
               in e.message for e in errors[1:]), errors


def _case_environment(name: str) -> tuple:
    import os

    return os.environ.get(name), dist.get_backend(), dist.get_world_size()


def test_ranks_see_the_environment_of_their_pools_start(monkeypatch, pools):
    # The fork server keeps the environment it started with (here: before the variable was set);
    # each pool hands its own to its ranks, as spawned ranks had it.
    assert pools(2).run(_case_environment, "MEGATRON_FSDP_POOL_PROBE")[0][0] is None
    monkeypatch.setenv("MEGATRON_FSDP_POOL_PROBE", "set before this pool")
    pool = WorkerPool(2)
    try:
        assert pool.run(_case_environment, "MEGATRON_FSDP_POOL_PROBE") == [("set before this pool", "gloo", 2)] * 2
    finally:
        pool.close()
