import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton's interpreter runs the Triton kernels' tests on CPU tensors (triton_testing.py). It must
    # be chosen before anything imports Triton: Triton's own library functions (tl.rand, ...) are
    # compiled or interpreted as Triton is imported, and a test module collected earlier may import it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from async_save_mode import install_if_asked  # noqa: E402
from distributed_pool import WorkerPool  # noqa: E402
from pretrain_in_pool import MOCK_INDEX_CACHE_ENV  # noqa: E402


install_if_asked()


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


# Markers of the steps that run apart from the default suite (scripts/run_tests.sh --step ...; CI
# runs each): their tests are collected only when -m names the marker, or a test is named by its id.
SEPARATE_STEPS = ("packaging", "soak", "restart", "compositions")


def pytest_configure(config):
    # The tiers: `-m "not e2e and not slow"` is the fast loop (docs/development.md); the default suite runs
    # everything but the separate steps; CI runs the suite and every step.
    config.addinivalue_line("markers", "e2e: launches the user's entry points as processes (torchrun, "
                                       "scripts)")
    config.addinivalue_line("markers", "slow: out of the fast loop: a case above about 3 s on a 2-core machine, "
                                       "or a pool case whose feature has its representative there")
    config.addinivalue_line("markers", "packaging: installs and builds into throwaway environments, and the "
                                       "build check's child interpreters (a step of its own: -m packaging)")
    config.addinivalue_line("markers", "soak: the statistical shutdown soak at full length (a step of its "
                                       "own: -m soak)")
    config.addinivalue_line("markers", "restart: torchrun --max-restarts jobs that crash and restart (a step of "
                                       "its own: -m restart)")
    config.addinivalue_line("markers", "compositions: end-to-end jobs beyond each feature's representative in the "
                                       "suite (a step of its own: -m compositions)")


def pytest_collection_modifyitems(config, items):
    named = config.getoption("markexpr") or ""
    apart = [m for m in SEPARATE_STEPS if not re.search(rf"\b{m}\b", named)]
    by_id = {arg.replace(os.sep, "/") for arg in config.args if "::" in arg}
    kept, deselected = [], []
    for item in items:
        chosen = item.nodeid in by_id or item.nodeid.split("[")[0] in by_id
        if not chosen and any(item.get_closest_marker(m) for m in apart):
            deselected.append(item)
        else:
            kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def shared_mock_indices(tmp_path_factory):
    """The session's index cache for the pool's --mock-data jobs (pretrain_in_pool.with_shared_mock_indices),
    in the environment before any pool starts: every rank gets it."""
    os.environ[MOCK_INDEX_CACHE_ENV] = str(tmp_path_factory.mktemp("mock_indices"))
    yield
    os.environ.pop(MOCK_INDEX_CACHE_ENV, None)


@pytest.fixture(scope="session")
def pools():
    """pools(world_size) -> a WorkerPool shared by every test of the session."""
    p = _Pools()
    yield p
    p.close()
