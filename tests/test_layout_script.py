"""scripts/layout.sh: the example jobs' layout from the processes this machine can start."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layout(tmp_path, gpus, **env):
    # A stand-in for the Python that reports torch's GPU count.
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\necho {gpus}\n")
    fake_python.chmod(0o755)
    script = f'PY={fake_python}; source {ROOT}/scripts/layout.sh; echo "$NPROC $TP $DP ${{TP_FLAGS[*]}}"'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **env})


@pytest.mark.e2e
@pytest.mark.parametrize("gpus, env, expected", [
    (0, {}, "4 2 2 --tensor-model-parallel-size 2 --sequence-parallel"),   # CPU: 4 gloo workers
    (1, {}, "1 1 1 --tensor-model-parallel-size 1"),                       # one GPU: one process
    (8, {}, "8 2 4 --tensor-model-parallel-size 2 --sequence-parallel"),   # one per GPU
    (3, {}, "3 1 3 --tensor-model-parallel-size 1"),
    (8, {"TP": "4"}, "8 4 2 --tensor-model-parallel-size 4 --sequence-parallel"),
    (0, {"NPROC": "2"}, "2 2 1 --tensor-model-parallel-size 2 --sequence-parallel"),
    (0, {"GPU_COUNT": "8"}, "8 2 4 --tensor-model-parallel-size 2 --sequence-parallel"),  # env.sh's count
])
def test_layout_follows_the_machine(tmp_path, gpus, env, expected):
    proc = _layout(tmp_path, gpus, **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


@pytest.mark.e2e
@pytest.mark.parametrize("env, message", [
    ({"NPROC": "4", "TP": "3"}, "TP=3 must be a positive integer that divides NPROC=4 (the processes on this node)"),
    ({"NPROC": "4", "TP": "08"}, "TP=08 must be a positive integer that divides NPROC=4 (the processes on this node)"),
    ({"NPROC": "two"}, "NPROC=two must be a positive integer (the processes on this node)"),
    ({"NPROC": "08"}, "NPROC=08 must be a positive integer (the processes on this node)"),
    ({"NPROC": "0"}, "NPROC=0 must be a positive integer (the processes on this node)"),
])
def test_a_bad_layout_is_one_line(tmp_path, env, message):
    proc = _layout(tmp_path, 0, **env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"layout: {message}"]
