"""The README's main command, in a short form, so it cannot rot."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*\| throughput \(tokens/s\): [\d.]+ \|.*"
    r"\| lm loss: ([\d.E+-]+) \|.*\| grad norm: ([\d.]+) \|")


def _run(*extra_args: str) -> tuple[list[tuple[int, float, float]], str]:
    env = dict(os.environ, MEGATRON_FSDP_VENV=os.path.dirname(os.path.dirname(sys.executable)))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_tiny.sh"), *extra_args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    rows = [LOG_LINE.search(line) for line in proc.stdout.splitlines()]
    return [(int(m[1]), float(m[3]), float(m[4])) for m in rows if m], proc.stdout


def test_readme_pretraining_command_trains_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    rows, out = _run("--train-iters", "24", "--log-interval", "4", "--save", ckpt, "--save-interval", "12")
    assert "tensor-parallel 2 x data-parallel 2" in out
    assert [r[0] for r in rows] == [4, 8, 12, 16, 20, 24], rows
    losses = [r[1] for r in rows]
    assert losses[-1] < losses[0] - 0.5, f"loss did not go down: {losses}"
    assert all(r[2] > 0 for r in rows)

    # Pretend the run stopped after iteration 12: resuming reproduces 13..24 exactly.
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("12\n")
    resumed, out = _run("--train-iters", "24", "--log-interval", "4", "--load", ckpt)
    assert "loaded checkpoint" in out and "at iteration 12" in out
    assert resumed == rows[3:], f"resumed {resumed} != uninterrupted {rows[3:]}"
