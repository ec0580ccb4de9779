import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton's interpreter runs the Triton kernels' tests on CPU tensors (triton_testing.py). It must
    # be chosen before anything imports Triton: Triton's own library functions (tl.rand, ...) are
    # compiled or interpreted as Triton is imported, and a test module collected earlier may import it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from distributed_pool import WorkerPool  # noqa: E402


class _Pools:
    def __init__(self):
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool

    def close(self):
        for pool in self._pools.values():
            pool.close()


def pytest_configure(config):
    # The tiers: `-m "not e2e and not slow"` is the fast loop (README); CI runs everything.
    config.addinivalue_line("markers", "e2e: launches the user's entry points as processes (torchrun, "
                                       "scripts, builds)")
    config.addinivalue_line("markers", "slow: a case that takes more than about 10 s on a 2-core machine")


@pytest.fixture(scope="session")
def pools():
    """pools(world_size) -> a WorkerPool shared by every test of the session."""
    p = _Pools()
    yield p
    p.close()
