"""The README's main command, in a short form, so it cannot rot."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*\| throughput \(tokens/s\): [\d.]+ \|.*"
    r"\| lm loss: ([\d.E+-]+) \|.*\| grad norm: ([\d.]+) \|")


def _run(*extra_args: str) -> list[tuple[int, float, float]]:
    env = dict(os.environ, MEGATRON_FSDP_VENV=os.path.dirname(os.path.dirname(sys.executable)))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_tiny.sh"), *extra_args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    rows = [LOG_LINE.search(line) for line in proc.stdout.splitlines()]
    return [(int(m[1]), float(m[3]), float(m[4])) for m in rows if m]


def test_readme_pretraining_command_trains():
    rows = _run("--train-iters", "24", "--log-interval", "4")
    assert [r[0] for r in rows] == [4, 8, 12, 16, 20, 24], rows
    losses = [r[1] for r in rows]
    assert losses[-1] < losses[0] - 0.5, f"loss did not go down: {losses}"
    assert all(r[2] > 0 for r in rows)
