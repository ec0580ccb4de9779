#!/usr/bin/env bash
# Runs the whole test suite (CPU, gloo worker processes), then the CUDA compile
# check (scripts/cuda_build_check.sh: the extension built with its CUDA kernels
# against a CUDA torch in .venv-cuda, and the host-side tests of that build;
# it needs nvcc, and MEGATRON_FSDP_SKIP_CUDA_BUILD=1 skips it). Where the
# extension under test already has its CUDA kernels (a CUDA torch with
# MEGATRON_FSDP_VENV=system), that build is the check. Extra arguments go to
# pytest, and then only pytest runs (a selection of tests, not the CI run).
# Fails when either fails.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# The suite must exercise the compiled extension, not its Python fallback.
export MEGATRON_FSDP_REQUIRE_EXTENSION=1
rc=0
# --durations: the slowest tests, so that a test that grew slow is seen (tiers: README).
"$PY" -m pytest -q --durations=15 tests "$@" || rc=$?
if [ "$#" -gt 0 ]; then
  echo "[run_tests] pytest arguments given: no CUDA build check (run without arguments for it)" >&2
elif "$PY" -c "import sys; from megatron_fsdp import kernels; sys.exit(not kernels.extension_has_cuda())" 2>/dev/null; then
  echo "[run_tests] the extension under test has its CUDA kernels: no separate CUDA build check" >&2
elif ! bash "$ROOT/scripts/cuda_build_check.sh"; then
  echo "[run_tests] the CUDA build check failed (above); MEGATRON_FSDP_SKIP_CUDA_BUILD=1 skips it" >&2
  [ "$rc" != 0 ] || rc=1
fi
exit "$rc"
