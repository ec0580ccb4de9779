"""Issue 9 items 11-13, through the training script as a user runs it (4 CPU
ranks under torchrun, TP=2 x FSDP=2), with the fault injected by
tests/pretrain_with_faults.py."""

import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--use-torch-fsdp2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--mock-data", "--vocab-size", "64", "--log-interval", "1",
         "--eval-iters", "0", "--num-workers", "0"]
LOSS = re.compile(r"iteration\s+(\d+)/.*\| lm loss: ([\d.E+-]+|NAN|nan) \|.*number of nan iterations:\s+(\d+) \|")


def _run(script: str, *args: str, fault: dict | None = None, timeout: float = 240):
    env = dict(os.environ, **{k: str(v) for k, v in (fault or {}).items()})
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           os.path.join(ROOT, script), *FLAGS, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def _losses(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in map(LOSS.search, out.splitlines()) if m}


def _tracker(ckpt) -> str:
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        return f.read().strip()


def test_nan_loss_on_one_rank_stops_every_rank_and_saves_nothing_bad(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    fault = dict(MEGATRON_FSDP_FAULT="nan", FAULT_RANK=1, FAULT_ITERATION=3)
    proc, _ = _run("tests/pretrain_with_faults.py", "--train-iters", "6", "--save", ckpt, "--save-interval", "1",
                   fault=fault)
    assert proc.returncode != 0
    # Rank 1's tensor-parallel peer (rank 0) computes the same poisoned loss.
    # Every rank raises the same error (torchrun may kill the slower ones
    # before they print it, once the first has failed).
    errors = re.findall(r"\[rank\d\]: megatron_fsdp\.training\.nan_check\.NonFiniteError: (.*)", proc.stderr)
    assert errors, proc.stderr[-3000:]
    assert all(e.startswith("iteration 3: NaN/inf loss on rank(s) [0, 1]") for e in errors), errors
    assert _tracker(ckpt) == "2"  # iteration 3's poisoned state was never saved
    assert not os.path.exists(os.path.join(ckpt, "iter_0000003"))

    # With the check off the run goes on, and the log counts the NaN iterations.
    proc, _ = _run("tests/pretrain_with_faults.py", "--train-iters", "4", "--no-check-for-nan-in-loss-and-grad",
                   fault=fault)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {m[1]: m for m in map(LOSS.search, proc.stdout.splitlines()) if m}
    assert rows["2"][3] == "0" and rows["3"][3] == "1" and rows["3"][2].lower() == "nan", proc.stdout


def test_sigterm_on_one_rank_saves_and_exits_zero_everywhere_and_resumes_exactly(tmp_path):
    reference, _ = _run("examples/pretrain_gpt.py", "--train-iters", "6")
    assert reference.returncode == 0, reference.stderr[-3000:]
    ckpt = str(tmp_path / "ckpt")
    proc, _ = _run("tests/pretrain_with_faults.py", "--train-iters", "6", "--exit-signal-handler", "--save", ckpt,
                   fault=dict(MEGATRON_FSDP_FAULT="sigterm", FAULT_RANK=1, FAULT_ITERATION=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exiting after iteration 3: a rank received SIGTERM" in proc.stdout
    assert _tracker(ckpt) == "3"
    resumed, _ = _run("examples/pretrain_gpt.py", "--train-iters", "6", "--load", ckpt)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = _losses(reference.stdout)
    assert _losses(proc.stdout) == {k: v for k, v in expected.items() if k <= 3}
    assert _losses(resumed.stdout) == {k: v for k, v in expected.items() if k > 3}


def test_a_stuck_rank_is_named_when_the_collective_times_out(tmp_path):
    proc, elapsed = _run("tests/pretrain_with_faults.py", "--train-iters", "4", "--distributed-timeout-minutes", "0.1",
                         fault=dict(MEGATRON_FSDP_FAULT="stall", FAULT_RANK=3, FAULT_ITERATION=2, FAULT_SECONDS=60))
    assert proc.returncode != 0
    assert "a collective timed out during 'iteration 2: " in proc.stderr, proc.stderr[-4000:]
    assert "rank 3 at 'iteration 1: " in proc.stderr, proc.stderr[-4000:]
    assert elapsed < 55, f"the stuck job took {elapsed:.0f} s to fail"
