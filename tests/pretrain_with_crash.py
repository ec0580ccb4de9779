"""examples/pretrain_gpt.py with one crash, for tests/test_elastic_restart.py.

    torchrun --max-restarts N ... tests/pretrain_with_crash.py <pretrain_gpt flags>

    CRASH_RANK=r  CRASH_ITERATION=k  [CRASH_ATTEMPT=a]
        in torchrun's attempt a (TORCHELASTIC_RESTART_COUNT; default 0, the first), rank r kills
        its own process with SIGKILL as iteration k starts (after iteration k - 1 and the
        checkpoint it saved): a crash that no handler sees, as the OOM killer's. k = 0: before
        start-up (before the process group).
    PAUSE_ITERATION=k  PAUSE_DIR=d
        as iteration k starts, unless d/go exists, every rank writes d/paused_<rank> ("<pid>
        <torchrun's pid>") and waits for d/go: the test kills what it means to kill (a node: its
        torchrun and workers) while the job stands still, then lets the others go on (into a
        collective with the dead, which fails).
    STALL_RANK=r  STALL_ATTEMPT=a  STALL_SECONDS=s
        rank r of attempt a sleeps s seconds before start-up: a rank that does not come.

A restarted attempt runs unchanged (but for a stall named for it). The example and the
package are untouched: the faults wrap megatron_fsdp.training.training.train_step, as
tests/pretrain_with_faults.py does.
"""

import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from megatron_fsdp.training import training  # noqa: E402
from pretrain_in_pool import pretrain_example  # noqa: E402

PAUSE_TIMEOUT_S = 300.0


def _crash() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _pause(directory: str, rank: int) -> None:
    go = os.path.join(directory, "go")
    if os.path.exists(go):
        return
    path = os.path.join(directory, f"paused_{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.replace(path + ".tmp", path)
    deadline = time.monotonic() + PAUSE_TIMEOUT_S
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no {go} after {PAUSE_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def main() -> None:
    env = os.environ
    attempt, rank = env.get("TORCHELASTIC_RESTART_COUNT", "0"), int(env["RANK"])
    if env.get("STALL_RANK") == str(rank) and env.get("STALL_ATTEMPT", "0") == attempt:
        time.sleep(float(env["STALL_SECONDS"]))
    crash_here = env.get("CRASH_RANK") == str(rank) and env.get("CRASH_ATTEMPT", "0") == attempt
    crash_at = int(env.get("CRASH_ITERATION", "-1")) if crash_here else -1
    pause_at = int(env.get("PAUSE_ITERATION", "-1"))
    if crash_at == 0:
        _crash()

    original_train_step = training.train_step

    def train_step(*args, iteration=None, **kwargs):
        starting = iteration + 1  # train_step's argument counts the iterations already done
        if starting == pause_at:
            _pause(env["PAUSE_DIR"], rank)
        if starting == crash_at:
            _crash()
        return original_train_step(*args, iteration=iteration, **kwargs)

    training.train_step = train_step
    pretrain_example()


if __name__ == "__main__":
    main()
