"""examples/pretrain_gpt.py with one injected fault, for tests/test_training_faults.py.

    torchrun ... tests/pretrain_with_faults.py <pretrain_gpt flags>
    MEGATRON_FSDP_FAULT=nan|signal|stall  FAULT_RANK=r  FAULT_ITERATION=k  [FAULT_SECONDS=s]  [FAULT_DIR=d]

nan: rank r's embedding output becomes NaN in iteration k. stall: rank r
sleeps s seconds before iteration k (a stuck rank). signal: after iteration
k's step every rank writes its pid to d/pid_<rank> and waits until the file
d/go exists, writing d/received_<rank> once its --exit-signal-handler has
seen a SIGTERM: the test signals the job from outside (a rank, torchrun, or
every process group) while the ranks wait, then lets them go on. The script
and the package are untouched: the fault wraps
megatron_fsdp.training.training.train_step and the example's model_provider,
for the job only (`injected`), so a worker pool's rank can run one as a case
(`nan_fault_job`) and go on unpatched.
"""

import contextlib
import os
import signal
import sys
import time

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
    try:
        yield model_provider
    finally:
        training.train_step = original_train_step


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
