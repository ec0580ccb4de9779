#!/usr/bin/env bash
# The tests, in steps (CI runs every step: .ci/run). Each step prints its time.
#
#   bash scripts/run_tests.sh                  the default suite: every test on CPU (gloo worker
#                                              processes) except those of the steps below
#   bash scripts/run_tests.sh -m "not e2e and not slow"   the fast loop (any pytest arguments:
#                                              the default suite's pytest with them)
#   bash scripts/run_tests.sh --step NAME ...  separate steps, in the order given:
#     packaging   the pip/env.sh installs into throwaway environments and the build check's child
#                 interpreters (pytest -m packaging: tests/test_build.py)
#     cuda_build  the CUDA sources compiled against a CUDA torch in .venv-cuda, and the host-side
#                 tests of that build (scripts/cuda_build_check.sh; without nvcc: skipped, in one line)
#     soak        the shutdown soak at full length (pytest -m soak; MEGATRON_FSDP_SHUTDOWN_CYCLES)
#     async_checkpoints  the checkpoint tests again, every save asynchronous (--async-save's path;
#                 tests/async_save_mode.py)
#     restart     torchrun --max-restarts jobs that crash and restart (pytest -m restart)
#     compositions  the end-to-end jobs beyond each feature's representative in the suite: context
#                 parallelism and experts composed with compile, recompute, fp8, checkpoints, the
#                 rest of their parity grids, their README commands (pytest -m compositions)
#     suite       the default suite (pytest arguments do not apply here)
#     all         suite, packaging, cuda_build, soak, async_checkpoints, restart, compositions
#
# Where the extension under test already has its CUDA kernels (a CUDA torch with
# MEGATRON_FSDP_VENV=system), the cuda_build step is that build: nothing more to compile.
# Fails when any step fails (the later steps still run).
set -euo pipefail

steps=()
while [ "$#" -gt 0 ] && [ "$1" = --step ]; do
  [ "$#" -ge 2 ] || { echo "[run_tests] --step needs a name: suite, packaging, cuda_build, soak, async_checkpoints, restart, compositions or all" >&2; exit 2; }
  case "$2" in
    all) steps+=(suite packaging cuda_build soak async_checkpoints restart compositions) ;;
    suite|packaging|cuda_build|soak|async_checkpoints|restart|compositions) steps+=("$2") ;;
    *) echo "[run_tests] unknown step '$2' (steps: suite, packaging, cuda_build, soak, async_checkpoints, restart, compositions, all)" >&2; exit 2 ;;
  esac
  shift 2
done
if [ "${#steps[@]}" -gt 0 ] && [ "$#" -gt 0 ]; then
  echo "[run_tests] pytest arguments go with the default suite only (no --step): got $*" >&2
  exit 2
fi
[ "${#steps[@]}" -gt 0 ] || steps=(suite)

SECONDS=0
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
echo "[run_tests] setup (scripts/env.sh: the environment and the extension's build): ${SECONDS} s" >&2
cd "$ROOT"
# The suite must exercise the compiled extension, not its Python fallback.
export MEGATRON_FSDP_REQUIRE_EXTENSION=1

pytest_args=("$@")
suite() {
  # --durations: the slowest tests, so that a test that grew slow is seen (tiers: docs/development.md).
  "$PY" -m pytest -q --durations=15 tests ${pytest_args[@]+"${pytest_args[@]}"}
}
packaging() { "$PY" -m pytest -q --durations=5 -m packaging tests; }
soak() { "$PY" -m pytest -q -m soak tests; }
restart() { "$PY" -m pytest -q -m restart tests; }
compositions() { "$PY" -m pytest -q --durations=5 -m compositions tests; }
# Every checkpoint test written for the synchronous save, unchanged, with each save asynchronous.
async_checkpoints() {
  MEGATRON_FSDP_TEST_ASYNC_SAVE=1 "$PY" -m pytest -q tests/test_checkpointing.py tests/test_checkpoint_faults.py \
    tests/test_checkpoint_vocab_padding.py tests/test_fp8_checkpoint.py tests/test_resume_checks.py \
    tests/test_checkpoint_formats.py tests/test_checkpoint_fp16.py
}
cuda_build() {
  if "$PY" -c "import sys; from megatron_fsdp import kernels; sys.exit(not kernels.extension_has_cuda())" 2>/dev/null; then
    echo "[run_tests] the extension under test has its CUDA kernels: no separate CUDA build to check" >&2
  else
    # A machine without nvcc skips it, saying so in one line; CI (.ci/run) requires it.
    MEGATRON_FSDP_CUDA_BUILD_OPTIONAL="${MEGATRON_FSDP_CUDA_BUILD_OPTIONAL:-1}" bash "$ROOT/scripts/cuda_build_check.sh"
  fi
}

rc=0
summary=()
for step in "${steps[@]}"; do
  start=$SECONDS
  echo "[run_tests] step $step" >&2
  if "$step"; then status=passed; else status=FAILED; rc=1; fi
  summary+=("$(printf '%-10s %-6s %5d s' "$step" "$status" $((SECONDS - start)))")
  echo "[run_tests] step $step: $status in $((SECONDS - start)) s" >&2
done
if [ "${#steps[@]}" -gt 1 ]; then
  printf '[run_tests] %s\n' "${summary[@]}" >&2
fi
exit "$rc"
