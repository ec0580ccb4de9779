"""scripts/gpu_check.sh's budget on a CPU: fake step timings (GPU_CHECK_FAKE_S) on a fake
clock, no GPU, no sleeping. Each case reads the steps' table (steps.tsv) and the last line."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWED = ["tests", "main_job_bf16", "main_job_fp8", "bench_e2e", "bench_gpt_fp8"]
# What each step took on the last GPU it ran on (H100, torch 2.11, 2026-11-27; BENCHMARKS.md), and
# 10 s (not measured) of preconditions before the first step: nvidia-smi and one torch import.
# bench_e2e's reduced arms, bench_gpt_fp8, profiling, bench_checkpoint, bench_context_parallel and bench_moe have
# no figure yet: they take their EXPECT_S.
MEASURED = "preconditions=10,build=63,tests=60,main_job_bf16=50,main_job_fp8=50"


def _gpu_check(tmp_path, fake, **env):
    """Runs the script with fake timings: (exit code, steps.tsv rows, last line of stdout)."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], capture_output=True, text=True,
                          timeout=60, env={"PATH": os.environ["PATH"], "PYTHON": sys.executable,
                                           "GPU_CHECK_OUT": str(out), "GPU_CHECK_FAKE_S": fake, **env})
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return proc.returncode, rows, last, proc


def _status(rows):
    return {name: status for name, status, _, _ in rows}


def _detail(rows, name):
    return next(detail for n, _, _, detail in rows if n == name)


def test_the_default_run_does_the_owed_steps_in_order_within_420s_on_the_last_measured_timings(tmp_path):
    rc, rows, last, proc = _gpu_check(tmp_path, MEASURED)
    assert rc == 0, proc.stdout + proc.stderr
    m = re.fullmatch(r"GPU CHECK PASSED in (\d+)s of (\d+)s(; .*)? \(logs and JSON in .*\)", last)
    assert m, last
    took, budget = int(m[1]), int(m[2])
    assert budget <= 420 and took <= budget
    ran = [name for name, status, _, _ in rows if status == "PASS"]
    assert ran[0] == "build"
    assert [name for name in ran if name in OWED] == OWED   # every owed step ran, in this order
    assert [name for name, _, _, _ in rows][:6] == ["build"] + OWED   # nothing runs before them
    assert sum(int(seconds) for _, _, seconds, _ in rows) + 10 == took


def test_the_owed_steps_fit_the_default_budget_when_each_takes_its_expected_seconds(tmp_path):
    # No step named: each takes its EXPECT_S, after 10 s of preconditions (nvidia-smi, torch).
    rc, rows, last, proc = _gpu_check(tmp_path, "preconditions=10")
    assert rc == 0, proc.stdout + proc.stderr
    assert all(_status(rows)[name] == "PASS" for name in ["build"] + OWED), rows
    assert re.search(r" of (\d+)s", last) and int(re.search(r" of (\d+)s", last)[1]) <= 420, last


def test_the_default_budget_bounds_a_step_at_420s_or_less(tmp_path):
    # Without GPU_CHECK_BUDGET_S: a step that would take forever gets what is left of the budget.
    rc, rows, last, proc = _gpu_check(tmp_path, "build=0,tests=100000")
    assert rc == 1, proc.stdout + proc.stderr
    limit = int(re.search(r"limit (\d+)s", _detail(rows, "tests"))[1])
    assert 0 < limit <= 420
    assert re.fullmatch(r"GPU CHECK FAILED in (\d+)s of \1s: tests; omitted, did not fit the budget: .*", last.split(
        " (logs")[0]), last


def test_a_step_that_does_not_fit_is_omitted_by_name_and_a_later_smaller_one_still_runs(tmp_path):
    # 223 s to the end of the main jobs, a slow bench_e2e (155): 42 s left, under bench_gpt_fp8's 45.
    rc, rows, last, proc = _gpu_check(tmp_path, "build=63,tests=60,main_job_bf16=50,main_job_fp8=50,bench_e2e=155,"
                                                "bench_copy_in=20,copy_out_reference=1")
    assert rc == 0, proc.stdout + proc.stderr
    status = _status(rows)
    assert status["bench_gpt_fp8"] == "OMITTED"
    assert _detail(rows, "bench_gpt_fp8") == "does not fit: expects 45 s, 42 s of the 420 s budget left"
    assert status["profiling"] == "PASS"              # 40 s of the 42: then 2 left
    assert status["bench_checkpoint"] == "OMITTED"    # 30 s
    assert _detail(rows, "bench_checkpoint") == "does not fit: expects 30 s, 2 s of the 420 s budget left"
    assert status["bench_context_parallel"] == "OMITTED"   # 60 s
    assert status["bench_moe"] == "OMITTED"           # 40 s
    assert status["bench_activations"] == "OMITTED"   # 50 s
    assert status["bench_copy_in"] == "OMITTED"       # 20 s
    assert status["bench_amax"] == "OMITTED"          # 20 s
    assert status["copy_out_reference"] == "OMITTED"  # 10 s
    assert last.startswith("GPU CHECK PASSED in 418s of 420s; omitted, did not fit the budget: bench_gpt_fp8, "
                           "bench_checkpoint, bench_context_parallel, bench_moe, bench_activations, bench_copy_in, "
                           "bench_amax, copy_out_reference (logs"), last


def test_a_failing_step_is_named_and_the_steps_after_it_still_run(tmp_path):
    rc, rows, last, proc = _gpu_check(tmp_path, MEASURED.replace("tests=60", "tests=fail"))
    assert rc == 1, proc.stdout + proc.stderr
    status = _status(rows)
    assert status["tests"] == "FAIL"
    assert _detail(rows, "tests") == "tests failed (fake: GPU_CHECK_FAKE_S says tests=fail)"
    assert all(status[name] == "PASS" for name in OWED[1:]), rows
    assert re.match(r"GPU CHECK FAILED in \d+s of \d+s: tests(;| \()", last), last


def test_after_a_failed_build_the_kernel_steps_are_not_run_and_the_main_jobs_still_are(tmp_path):
    rc, rows, last, proc = _gpu_check(tmp_path, "build=fail")
    assert rc == 1, proc.stdout + proc.stderr
    status = _status(rows)
    assert status["build"] == "FAIL"
    assert status["tests"] == status["bench_copy_in"] == status["bench_amax"] == "NOT RUN"
    assert status["main_job_bf16"] == status["main_job_fp8"] == "PASS"
    assert re.match(r"GPU CHECK FAILED in \d+s of \d+s: build, tests, ", last), last


def test_steps_left_out_by_gpu_check_steps_are_told_apart_from_those_that_did_not_fit(tmp_path):
    rc, rows, last, proc = _gpu_check(tmp_path, "build=63,tests=60,bench_e2e=150,bench_amax=20",
                                      GPU_CHECK_STEPS="build,tests bench_e2e,bench_activations,bench_amax",
                                      GPU_CHECK_BUDGET_S="300")
    assert rc == 0, proc.stdout + proc.stderr
    status = _status(rows)
    left_out = ["main_job_bf16", "main_job_fp8", "bench_gpt_fp8", "profiling", "bench_checkpoint",
                "bench_context_parallel", "bench_moe", "bench_copy_in", "copy_out_reference"]
    for name in left_out:
        assert (status[name], _detail(rows, name)) == ("OMITTED", "not in GPU_CHECK_STEPS")
    assert (status["bench_activations"], _detail(rows, "bench_activations")) == (
        "OMITTED", "does not fit: expects 50 s, 27 s of the 300 s budget left")
    assert status["bench_amax"] == "PASS"
    assert last.startswith(f"GPU CHECK PASSED in 293s of 300s; omitted, not in GPU_CHECK_STEPS: {', '.join(left_out)}; "
                           "omitted, did not fit the budget: bench_activations (logs"), last

    # GPU_CHECK_E2E_S=0 leaves bench_e2e out on purpose, too.
    rc, rows, last, proc = _gpu_check(tmp_path, MEASURED, GPU_CHECK_E2E_S="0")
    assert rc == 0, proc.stdout + proc.stderr
    assert _detail(rows, "bench_e2e") == "not in GPU_CHECK_STEPS (GPU_CHECK_E2E_S=0)"
    assert "; omitted, not in GPU_CHECK_STEPS: bench_e2e" in last, last


def test_a_step_past_its_limit_fails_as_a_timeout_and_leaves_no_time_to_the_rest(tmp_path):
    # 173 s to the end of main_job_bf16: main_job_fp8 may use the 247 s left, and takes 400.
    rc, rows, last, proc = _gpu_check(tmp_path, MEASURED.replace("preconditions=10,", "").replace(
        "main_job_fp8=50", "main_job_fp8=400"))
    assert rc == 1, proc.stdout + proc.stderr
    row = next(r for r in rows if r[0] == "main_job_fp8")
    assert row[1:] == ["FAIL", "247", "main_job_fp8 failed or timed out (fake: takes 400s, limit 247s)"]
    after = ["bench_e2e", "bench_gpt_fp8", "profiling", "bench_checkpoint", "bench_context_parallel", "bench_moe",
             "bench_activations", "bench_copy_in", "bench_amax", "copy_out_reference"]
    for name in after:
        assert _status(rows)[name] == "OMITTED"
        assert re.fullmatch(r"does not fit: expects \d+ s, 0 s of the 420 s budget left", _detail(rows, name))
    assert last.startswith(f"GPU CHECK FAILED in 420s of 420s: main_job_fp8; omitted, did not fit the budget: "
                           f"{', '.join(after)} (logs"), last


def test_a_fake_timing_that_is_not_step_seconds_or_fail_is_refused(tmp_path):
    for fake in ("tests=soon", "test=60", "=60"):
        proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], capture_output=True, text=True,
                              timeout=60, env={"PATH": os.environ["PATH"], "PYTHON": sys.executable,
                                               "GPU_CHECK_OUT": str(tmp_path), "GPU_CHECK_FAKE_S": fake})
        assert proc.returncode == 2, (fake, proc.stderr)
        assert proc.stderr.startswith(f"GPU_CHECK_FAKE_S: '{fake}' is not step=seconds or step=fail"), proc.stderr
