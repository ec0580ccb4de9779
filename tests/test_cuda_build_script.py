"""scripts/cuda_build_check.sh on a machine without nvcc: the test command skips the CUDA build
check in one line (run_tests.sh makes it optional), CI (.ci/run) fails it. No compiler runs."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _without_nvcc(tmp_path, **env):
    """An environment in which no nvcc is found: PATH a directory of links to /usr/bin's and /bin's
    commands but nvcc (a distribution's CUDA toolkit may install one there), no CUDA_HOME, and the
    last place looked in (/usr/local/cuda) moved to an empty directory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in ("/usr/bin", "/bin"):
        for name in os.listdir(directory):
            if name != "nvcc" and not os.path.lexists(bin_dir / name):
                os.symlink(os.path.join(directory, name), bin_dir / name)
    return {"HOME": os.environ.get("HOME", str(tmp_path)), "PATH": str(bin_dir),
            "MEGATRON_FSDP_CUDA_DEFAULT_HOME": str(tmp_path / "no-cuda"), **env}


def _run(args, env):
    proc = subprocess.run(["bash", *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.startswith("[cuda-build]")]


def test_without_nvcc_an_optional_check_is_skipped_in_one_line(tmp_path):
    rc, lines = _run([os.path.join(ROOT, "scripts", "cuda_build_check.sh")],
                     _without_nvcc(tmp_path, MEGATRON_FSDP_CUDA_BUILD_OPTIONAL="1"))
    assert rc == 0
    assert len(lines) == 1 and "skipped: nvcc not found" in lines[0], lines
    assert str(tmp_path / "no-cuda" / "bin") in lines[0]


def test_without_nvcc_a_required_check_fails(tmp_path):
    rc, lines = _run([os.path.join(ROOT, "scripts", "cuda_build_check.sh")],
                     _without_nvcc(tmp_path, MEGATRON_FSDP_CUDA_BUILD_OPTIONAL="0"))
    assert rc == 1
    assert lines and lines[0].startswith("[cuda-build] FAILED: nvcc not found"), lines


def test_ci_requires_the_cuda_build_check():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        assert "export MEGATRON_FSDP_CUDA_BUILD_OPTIONAL=0" in f.read()


@pytest.mark.packaging  # the test command's own setup (scripts/env.sh) in a child shell
def test_the_test_commands_cuda_build_step_passes_without_nvcc(tmp_path):
    env = _without_nvcc(tmp_path)
    if os.environ.get("MEGATRON_FSDP_VENV"):
        env["MEGATRON_FSDP_VENV"] = os.environ["MEGATRON_FSDP_VENV"]
    rc, lines = _run([os.path.join(ROOT, "scripts", "run_tests.sh"), "--step", "cuda_build"], env)
    assert rc == 0
    assert any("skipped: nvcc not found" in line for line in lines), lines
