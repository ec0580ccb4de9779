"""examples/pretrain_gpt.py's job run by a worker pool's ranks instead of torchrun.

The pool's ranks have torch and megatron_fsdp imported already, so a short job
costs its training alone, not four interpreter starts on two cores. For the
checks about what pretrain() computes (losses, resumes, logs, checkpoint
checks, the one-line error a failed job prints and the error files torchrun
would read); what the launcher itself does (signals, torchrun's summary) stays
with the torchrun tests. Use as a pool case:

    outputs = pools(4).run(pretrain_gpt_job, argv)   # each rank's stdout, and its exit code
    outputs = pools(2).run(pretrain_gpt_job, argv, True)   # a failing job: and stderr, error file
    outputs = pools(2).run(script_job, path)         # any script that brings its own process group

pretrain() brings its own process group and ends it: the pool's group makes way
and comes back afterwards, each on a port of its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import shutil
import sys
import tempfile
from unittest import mock

import torch.distributed as dist

from distributed_pool import agree_on_free_ports, init_pool_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def own_process_group_job():
    """Inside: the pool's process group is gone and MASTER_PORT names a fresh port, so the job
    brings its own group (as under torchrun) and ends it; afterwards the pool's group is back."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    job_port, pool_port = agree_on_free_ports(2)
    dist.barrier()
    dist.destroy_process_group()
    saved_port = os.environ["MASTER_PORT"]
    os.environ.update(MASTER_PORT=str(job_port), LOCAL_WORLD_SIZE=str(world_size))
    try:
        yield
    finally:
        if dist.is_initialized():  # a job that failed before its own shutdown
            dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(pool_port)
        init_pool_group(rank, world_size)
        os.environ["MASTER_PORT"] = saved_port


def run_job(argv: list[str], main, *, failing: bool = False) -> tuple:
    """`main()` with sys.argv = argv in its own process group, stdout captured: (exit code, stdout).
    `failing`: a job expected to fail, run as torchrun would run it (each rank with an error file,
    TORCHELASTIC_ERROR_FILE): (exit code, stdout, stderr, the error file's JSON or None)."""
    saved_argv, sys.argv = sys.argv, with_shared_mock_indices(argv)
    out, err, code = io.StringIO(), io.StringIO(), 0
    error_file = os.path.join(tempfile.mkdtemp(prefix="job_error_"), "error.json") if failing else None
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(own_process_group_job())
            stack.enter_context(contextlib.redirect_stdout(out))
            if failing:
                stack.enter_context(contextlib.redirect_stderr(err))
                stack.enter_context(mock.patch.dict(os.environ, TORCHELASTIC_ERROR_FILE=error_file))
            main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved_argv
    if not failing:
        return code, out.getvalue()
    written = None
    if os.path.exists(error_file):
        with open(error_file) as f:
            written = json.load(f)
    shutil.rmtree(os.path.dirname(error_file), ignore_errors=True)
    return code, out.getvalue(), err.getvalue(), written


# Where --mock-data jobs of the session keep their indices (conftest.py sets it for the session).
MOCK_INDEX_CACHE_ENV = "MEGATRON_FSDP_TEST_MOCK_INDEX_CACHE"


def with_shared_mock_indices(argv: list[str]) -> list[str]:
    """`argv`, with --data-cache-path set to the session's directory for a --mock-data job that
    names none. Megatron's mock corpus is 100000 sequences: at the tests' short sequences its
    indices hold millions of samples, about 0.7 s per rank per job to build; the jobs of one
    configuration build them once (rank 0 first, as with any cache) and the others load the
    same bytes."""
    cache = os.environ.get(MOCK_INDEX_CACHE_ENV)
    if cache and "--mock-data" in argv and "--data-cache-path" not in argv:
        return [*argv, "--data-cache-path", cache]
    return argv


def pretrain_gpt_module():
    """examples/pretrain_gpt.py, imported as the module `pretrain_gpt`."""
    if os.path.join(ROOT, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "examples"))
    import pretrain_gpt

    return pretrain_gpt


def pretrain_example(model_provider=None) -> None:
    """What `pretrain_gpt.py`'s `__main__` does, with another model provider if given."""
    pretrain_gpt = pretrain_gpt_module()
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    pretrain_gpt.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                          model_provider or pretrain_gpt.model_provider, pretrain_gpt.ModelType.encoder_or_decoder,
                          pretrain_gpt.forward_step)


def pretrain_gpt_job(argv: list[str], failing: bool = False) -> tuple:
    """Run `pretrain_gpt.py *argv` on every rank of the pool: (exit code, this rank's stdout); with
    `failing`, also its stderr and error file (run_job)."""
    return run_job([os.path.join(ROOT, "examples", "pretrain_gpt.py"), *argv], pretrain_example, failing=failing)


def generate_gpt_job(argv: list[str]) -> tuple[int, str]:
    """Run `generate_gpt.py *argv` on every rank of the pool: (exit code, this rank's stdout)."""
    if os.path.join(ROOT, "examples") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "examples"))
    path = os.path.join(ROOT, "examples", "generate_gpt.py")
    return run_job([path, *argv], lambda: runpy.run_path(path, run_name="__main__"))


def script_job(path: str) -> tuple[int, str]:
    """Run the Python script at `path` as `__main__` on every rank of the pool, as torchrun would
    with the pool's world size: (exit code, this rank's stdout)."""
    return run_job([path], lambda: runpy.run_path(path, run_name="__main__"))
