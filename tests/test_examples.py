"""The README's main command, in a short form, so it cannot rot."""

import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest

from pretrain_in_pool import pretrain_gpt_job, script_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \|.*\| throughput per GPU \(TFLOP/s/GPU\): [\d.]+ \|"
    r" throughput per GPU \(tokens/s/GPU\): [\d.]+ \|.*"
    r"\| lm loss: ([\d.E+-]+) \|.*\| grad norm: ([\d.]+) \|")


def _rows(out: str) -> list[tuple[int, float, float]]:
    """(iteration, loss, grad norm) of each log line."""
    rows = [LOG_LINE.search(line) for line in out.splitlines()]
    return [(int(m[1]), float(m[3]), float(m[4])) for m in rows if m]


def _run(*extra_args: str) -> tuple[list[tuple[int, float, float]], str, int, list[str]]:
    """The README's command with `extra_args`: its log rows, its stdout, and the processes and
    example flags it launched (read off bash's trace of its torchrun line)."""
    env = dict(os.environ, MEGATRON_FSDP_VENV=os.path.dirname(os.path.dirname(sys.executable)))
    proc = subprocess.run(["bash", "-x", os.path.join(ROOT, "scripts", "pretrain_gpt_tiny.sh"), *extra_args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    (launch,) = [shlex.split(line[2:]) for line in proc.stderr.splitlines() if line.startswith("+ exec ")]
    # Before the launch, one interpreter start asks torch what it is and how many GPUs it sees.
    assert sum("import torch" in line for line in proc.stderr.splitlines() if line.startswith("+")) == 1, proc.stderr
    nproc = int(launch[launch.index("--nproc-per-node") + 1])
    flags = launch[launch.index("examples/pretrain_gpt.py") + 1:]
    assert flags[len(flags) - len(extra_args):] == list(extra_args), flags
    return _rows(proc.stdout), proc.stdout, nproc, flags[:len(flags) - len(extra_args)]


@pytest.mark.e2e
def test_readme_pretraining_command_trains_and_resumes(tmp_path, pools):
    ckpt = str(tmp_path / "ckpt")
    rows, out, nproc, flags = _run("--train-iters", "8", "--log-interval", "2", "--save", ckpt, "--save-interval", "4")
    assert "tensor-parallel 2 x data-parallel 2" in out
    assert "> FSDP2 copy ops: megatron_fsdp's kernels" in out  # on by default in pretrain(), and said so
    assert [r[0] for r in rows] == [2, 4, 6, 8], rows
    losses = [r[1] for r in rows]
    assert losses[-1] < losses[0] - 0.5, f"loss did not go down: {losses}"
    assert all(r[2] > 0 for r in rows)

    # Pretend the run stopped after iteration 4: resuming with the command's flags reproduces
    # 5..8 exactly. (What a resume computes: pretrain() on the worker pool's ranks, not another
    # launch; the launcher ran above.)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("4\n")
    outcomes = pools(nproc).run(pretrain_gpt_job, [*flags, "--train-iters", "8", "--log-interval", "2",
                                                   "--load", ckpt], timeout=400)
    out = "".join(text for _, text in outcomes)
    assert [code for code, _ in outcomes] == [0] * nproc, out[-3000:]
    assert "loaded checkpoint" in out and "at iteration 4" in out
    resumed = _rows(out)
    assert resumed == rows[2:], f"resumed {resumed} != uninterrupted {rows[2:]}"


def documentation() -> list[str]:
    """The README and the pages it links (docs/), repository-relative."""
    return ["README.md", *sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                 if f.endswith(".md"))]


def _python_blocks() -> list[tuple[str, str]]:
    """(page, block) of every ```python block of the documentation, in page order."""
    found = []
    for page in documentation():
        with open(os.path.join(ROOT, page)) as f:
            found += [(page, block) for block in re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)]
    return found


def test_documented_python_examples_are_whole_scripts_that_end_cleanly():
    # torch + gloo aborts about one finished run in five at exit without the
    # barrier of shutdown_distributed(): a copied example must end with it.
    blocks = [block for _, block in _python_blocks()]
    assert len(blocks) >= 4
    for block in blocks:
        lines = block.strip().splitlines()
        assert re.match(r"# torchrun --nproc-per-node \d+ ", lines[0]), lines[0]
        assert lines[-1].startswith("shutdown_distributed()"), lines[-1]


@pytest.mark.slow  # a script job in the worker pool
@pytest.mark.parametrize("page, block", _python_blocks(),
                         ids=[f"{page}:{i}" for i, (page, _) in enumerate(_python_blocks())])
def test_documented_python_snippets_run_as_written(tmp_path, page, block, pools):
    """Each ```python block of the README's pages, alone, on as many ranks as the torchrun line it
    starts with names: the worker pool's ranks run it as torchrun's would, with its own process
    group, and it warns nothing. (That the script as a whole ends cleanly is the test above; the
    launcher is the README command's test.)"""
    nproc = int(re.match(r"# torchrun --nproc-per-node (\d+) ", block).group(1))
    script = tmp_path / "documented_snippet.py"
    script.write_text(block)
    outcomes = pools(nproc).run(_script_recording_warnings, str(script), timeout=300)
    assert [code for code, _, _ in outcomes] == [0] * nproc, "".join(out for _, out, _ in outcomes)[-4000:]
    assert [said for _, _, said in outcomes] == [[]] * nproc


def _script_recording_warnings(path: str):
    """script_job(path) and the warnings its rank raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out = script_job(path)
    return code, out, [f"{w.category.__name__}: {w.message}" for w in caught]


BAD_FLAGS = ["--num-layers", "0", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64"]


def _script_in_process(monkeypatch, capfd, rank: int, *flags: str) -> tuple[int, str, str]:
    """examples/pretrain_gpt.py run in this process as rank `rank` of 4: (exit code, stdout, stderr).
    A flag error ends it before anything distributed starts, so no process group is needed."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "4")
    script = os.path.join(ROOT, "examples", "pretrain_gpt.py")
    monkeypatch.setattr(sys, "argv", [script, *flags])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    out, err = capfd.readouterr()
    return exit_info.value.code, out, err


def test_a_bad_flag_is_one_line_on_rank_zero_with_exit_code_2(monkeypatch, capfd):
    """The script as rank 0 of 4 sees it (run in this process): one line on stderr, exit code 2."""
    code, out, err = _script_in_process(monkeypatch, capfd, 0, *BAD_FLAGS)
    assert (code, out) == (2, "")
    assert err.strip().splitlines() == ["pretrain_gpt.py: error: --num-layers must be a positive integer, got 0"]


@pytest.mark.parametrize("script", ["pretrain_gpt.py", "generate_gpt.py"])
@pytest.mark.parametrize("tp", ["1", "2"])
def test_a_script_started_without_torchrun_says_how_to_start_it(monkeypatch, capfd, script, tp):
    """`python examples/pretrain_gpt.py ...`: one line naming torchrun, exit code 2, before the flags
    are read (at TP 2 they blamed --tensor-model-parallel-size; at TP 1 torch's missing RANK showed)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = os.path.join(ROOT, "examples", script)
    monkeypatch.setattr(sys, "argv", [path, *BAD_FLAGS[2:], "--num-layers", "2", "--tensor-model-parallel-size", tp])
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(path, run_name="__main__")
    out, err = capfd.readouterr()
    assert exit_info.value.code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: RANK and WORLD_SIZE are not set: start this "
                                                   f"script with torchrun, e.g. `torchrun --nproc-per-node N {path}"), err
    # --help needs no launcher: it prints the flags.
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(path, run_name="__main__")
    out, err = capfd.readouterr()
    assert exit_info.value.code == 0 and "--tensor-model-parallel-size" in out and err == "", err


def test_a_bad_flag_is_silent_on_the_other_ranks_and_an_unknown_flag_is_one_line(monkeypatch, capfd):
    code, out, err = _script_in_process(monkeypatch, capfd, 1, *BAD_FLAGS)
    assert (code, out, err) == (2, "", "")
    code, out, err = _script_in_process(monkeypatch, capfd, 0, *BAD_FLAGS[2:], "--num-layers", "2", "--no-such-flag")
    assert code == 2 and out == "" and err.strip().splitlines() == [
        "pretrain_gpt.py: error: unrecognized arguments: --no-such-flag"], err


def test_sequence_parallel_at_tp1_warns_and_is_turned_off():
    import warnings

    from megatron_fsdp.training.arguments import parse_args
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                           "--seq-length", "32", "--micro-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
                           "--mock-data", "--vocab-size", "64", "--sequence-parallel"])
    assert args.sequence_parallel is False
    assert any("--sequence-parallel has no effect" in str(w.message) for w in caught)
