"""examples/pretrain_gpt.py with one injected fault, for tests/test_training_faults.py.

    torchrun ... tests/pretrain_with_faults.py <pretrain_gpt flags>
    MEGATRON_FSDP_FAULT=nan|signal|stall|kill_in_save|oom  FAULT_RANK=r  FAULT_ITERATION=k  [FAULT_SECONDS=s]
    [FAULT_DIR=d]

nan: rank r's embedding output becomes NaN in iteration k. stall: rank r
sleeps s seconds before iteration k (a stuck rank). signal: after iteration
k's step every rank writes its pid to d/pid_<rank> and waits until the file
d/go exists, writing d/received_<rank> once its --exit-signal-handler has
seen a SIGTERM: the test signals the job from outside (a rank, torchrun, or
every process group) while the ranks wait, then lets them go on. kill_in_save:
the checkpoint of iteration k is written slowly (s seconds per file, every
rank), and rank r kills itself (SIGKILL) once it wrote its first file: with
--async-save, a kill -9 in the middle of a background write. oom: rank r asks
CUDA for 256 TiB before iteration k (a real out-of-memory error; scripts/gpu_check.sh). The script
and the package are untouched: the fault wraps
megatron_fsdp.training.training.train_step and the example's model_provider,
for the job only (`injected`), so a worker pool's rank can run one as a case
(`nan_fault_job`; `signal_fault_job`, where rank 0 sends the signal) and go on
unpatched.
"""

import contextlib
import os
import signal
import sys
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import pretrain_gpt  # noqa: E402

from megatron_fsdp.training import training  # noqa: E402
from pretrain_in_pool import pretrain_example, run_job  # noqa: E402


def _sigterm_seen() -> bool:
    handler = signal.getsignal(signal.SIGTERM)  # DistributedSignalHandler._record, bound
    return bool(getattr(getattr(handler, "__self__", None), "_received", False))


def wait_for_signal(directory: str, timeout: float = 300.0) -> None:
    rank = os.environ["RANK"]
    with open(os.path.join(directory, f"pid_{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(directory, f"pid_{rank}.tmp"), os.path.join(directory, f"pid_{rank}"))
    reported, deadline = False, time.monotonic() + timeout
    while not os.path.exists(os.path.join(directory, "go")):
        if not reported and _sigterm_seen():
            open(os.path.join(directory, f"received_{rank}"), "w").close()
            reported = True
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no {directory}/go after {timeout} s")
        time.sleep(0.05)


@contextlib.contextmanager
def injected(fault: str, rank: int, at_iteration: int, seconds: float = 0.0, directory: str = ""):
    """Inside: training.train_step carries the fault; yields the model provider to pretrain with."""
    current = {"iteration": 0}
    here = int(os.environ["RANK"]) == rank
    original_train_step = training.train_step

    def train_step(*args, iteration=None, **kwargs):
        current["iteration"] = iteration + 1  # train_step's argument counts the iterations already done
        if fault == "stall" and here and current["iteration"] == at_iteration:
            time.sleep(seconds)
        if fault == "oom" and here and current["iteration"] == at_iteration:
            torch.empty(1 << 48, dtype=torch.uint8, device="cuda")
        result = original_train_step(*args, iteration=iteration, **kwargs)
        if fault == "signal" and current["iteration"] == at_iteration:
            wait_for_signal(directory)
        return result

    def model_provider(*args, **kwargs):
        model = pretrain_gpt.model_provider(*args, **kwargs)

        def poison(module, inputs, output):
            if here and current["iteration"] == at_iteration:
                return output * float("nan")
            return output

        if fault == "nan":
            model.embedding.register_forward_hook(poison)
        return model

    training.train_step = train_step
    with _killed_in_save(rank, at_iteration, seconds) if fault == "kill_in_save" else contextlib.nullcontext():
        try:
            yield model_provider
        finally:
            training.train_step = original_train_step


@contextlib.contextmanager
def _killed_in_save(rank: int, at_iteration: int, seconds: float):
    from megatron_fsdp.dist_checkpointing import checksums

    real = checksums.ChecksumFileSystem.create_stream
    here = int(os.environ["RANK"]) == rank

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield stream
        if "w" in mode and f"iter_{at_iteration:07d}.tmp-" in str(path):
            time.sleep(seconds)
            if here:
                os.kill(os.getpid(), signal.SIGKILL)

    checksums.ChecksumFileSystem.create_stream = create_stream
    try:
        yield
    finally:
        checksums.ChecksumFileSystem.create_stream = real


def _signal_from_rank_zero(directory: str, target: int, world_size: int, failures: list,
                           timeout: float = 30.0) -> None:
    """What the test does from outside under torchrun, done by a thread of rank 0: once every rank
    waits after the fault's iteration, SIGTERM to rank `target`'s process; once its handler saw
    it, every rank goes on (they go on after a failure here too, which lands in `failures`)."""
    def wait_for(path):
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {path} after {timeout} s")
            time.sleep(0.05)

    try:
        for rank in range(world_size):
            wait_for(os.path.join(directory, f"pid_{rank}"))
        with open(os.path.join(directory, f"pid_{target}")) as f:
            os.kill(int(f.read()), signal.SIGTERM)
        wait_for(os.path.join(directory, f"received_{target}"))
    except Exception as exc:  # noqa: BLE001  (raised by the job's thread: signal_fault_job)
        failures.append(exc)
    finally:
        open(os.path.join(directory, "go"), "w").close()


def signal_fault_job(argv: list[str], target: int, iteration: int, directory: str) -> tuple[int, str]:
    """A worker pool case: every rank waits after `iteration`'s step (the "signal" fault) while
    rank 0 sends SIGTERM to rank `target`, then they go on: (exit code, stdout)."""
    failures = []

    def main():
        with injected("signal", 0, iteration, directory=directory) as model_provider:
            signaller = None
            if int(os.environ["RANK"]) == 0:
                signaller = threading.Thread(target=_signal_from_rank_zero, daemon=True, args=(
                    directory, target, int(os.environ["WORLD_SIZE"]), failures))
                signaller.start()
            try:
                pretrain_example(model_provider)
            finally:
                if signaller is not None:
                    signaller.join(timeout=5)

    outcome = run_job([os.path.join(ROOT, "tests", "pretrain_with_faults.py"), *argv], main)
    if failures:
        raise failures[0]
    return outcome


def nan_fault_job(argv: list[str], rank: int, iteration: int) -> tuple[int, str]:
    """A worker pool case: the job with rank `rank`'s loss NaN in `iteration`: (exit code, stdout)."""
    def main():
        with injected("nan", rank, iteration) as model_provider:
            pretrain_example(model_provider)
    return run_job([os.path.join(ROOT, "tests", "pretrain_with_faults.py"), *argv], main)


if __name__ == "__main__":
    with injected(os.environ["MEGATRON_FSDP_FAULT"], int(os.environ["FAULT_RANK"]), int(os.environ["FAULT_ITERATION"]),
                  float(os.environ.get("FAULT_SECONDS", "0")), os.environ.get("FAULT_DIR", "")) as provider:
        pretrain_example(provider)
