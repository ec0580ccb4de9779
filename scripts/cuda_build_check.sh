#!/usr/bin/env bash
# CI's CUDA compile check, run by scripts/run_tests.sh after the CPU suite: a
# CUDA compile error fails CI here instead of waiting for a GPU machine.
#
# In a second environment (.venv-cuda) with a CUDA build of torch, it builds
# the extension with its CUDA kernels out of tree (setup.py build_ext into
# .venv-cuda/megatron_fsdp_build: the checkout's own megatron_fsdp/_C*.so is
# not touched), checks the build (it has the CUDA kernels; an error raised in
# it arrives as an exception), then runs the host-side tests of that build
# under that torch (no GPU needed: the CUDA kernels' plans run on the host, and
# the Triton kernels in Triton's interpreter),
# from a copy of the tree whose megatron_fsdp/_C*.so is the CUDA build.
# Nothing is rebuilt when csrc/, setup.py, pyproject.toml, the build check and
# this script are unchanged; the environment is reused.
#
#   MEGATRON_FSDP_SKIP_CUDA_BUILD=1  skip all of it
#   MEGATRON_FSDP_CUDA_BUILD_OPTIONAL=1  without nvcc, skip it with one line instead of failing
#                                    (scripts/run_tests.sh sets it; .ci/run does not: CI has nvcc)
#   MEGATRON_FSDP_CUDA_DEFAULT_HOME  the toolkit looked in last (default: /usr/local/cuda)
#   MEGATRON_FSDP_CUDA_VENV          the environment (default: <repo>/.venv-cuda)
#   MEGATRON_FSDP_CUDA_TORCH         torch to install there (default: torch==2.14.1, a CUDA build)
#   MEGATRON_FSDP_CUDA_ARCH_LIST     TORCH_CUDA_ARCH_LIST for the build (default: $TORCH_CUDA_ARCH_LIST,
#                                    else 9.0: one architecture, Hopper, as the point is to compile;
#                                    `default` lets setup.py choose as on a GPU-less build node)
#   PYTHON                           the interpreter that creates the environment (default: python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { echo "[cuda-build] $*" >&2; }
die() { echo "[cuda-build] FAILED: $*" >&2; exit 1; }

if [ "${MEGATRON_FSDP_SKIP_CUDA_BUILD:-0}" = 1 ]; then
  say "skipped (MEGATRON_FSDP_SKIP_CUDA_BUILD=1): the CUDA sources were not compiled"
  exit 0
fi
SECONDS=0

nvcc=""
for candidate in ${CUDA_HOME:+"$CUDA_HOME/bin/nvcc"} ${CUDA_PATH:+"$CUDA_PATH/bin/nvcc"} "$(command -v nvcc || true)" \
                 "${MEGATRON_FSDP_CUDA_DEFAULT_HOME:-/usr/local/cuda}/bin/nvcc"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ]; then nvcc="$candidate"; break; fi
done
if [ -z "$nvcc" ] && [ "${MEGATRON_FSDP_CUDA_BUILD_OPTIONAL:-0}" = 1 ]; then
  say "skipped: nvcc not found (\$CUDA_HOME/bin, \$CUDA_PATH/bin, PATH, ${MEGATRON_FSDP_CUDA_DEFAULT_HOME:-/usr/local/cuda}/bin): the CUDA sources were not compiled here; CI compiles them"
  exit 0
fi
if [ -z "$nvcc" ]; then
  die "nvcc not found (looked in \$CUDA_HOME/bin, \$CUDA_PATH/bin, PATH and ${MEGATRON_FSDP_CUDA_DEFAULT_HOME:-/usr/local/cuda}/bin). The test run
compiles the CUDA sources (csrc/*.cu) with it so that a CUDA compile error cannot wait for a GPU machine.
Install the CUDA toolkit (or set CUDA_HOME), or set MEGATRON_FSDP_SKIP_CUDA_BUILD=1 to skip this check."
fi
if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null 2>&1; then
  export CUDA_HOME="$(dirname "$(dirname "$nvcc")")"  # torch finds nvcc on PATH or through CUDA_HOME
fi
say "nvcc: $nvcc ($("$nvcc" --version | grep -o 'release [0-9.]*' || echo 'version unknown'))"

CV="${MEGATRON_FSDP_CUDA_VENV:-$ROOT/.venv-cuda}"
PYC="$CV/bin/python"
torch_req="${MEGATRON_FSDP_CUDA_TORCH:-torch==2.14.1}"
if [ ! -x "$PYC" ]; then
  say "creating $CV"
  "${PYTHON:-python3}" -m venv "$CV"
fi
# (Re)install when torch is missing or the requirement changed; pip takes the wheels from the
# machine's wheel cache or index when it has them (CI's image does), else downloads about 3 GB.
if [ "$(cat "$CV/.torch_requirement" 2>/dev/null || true)" != "$torch_req" ] \
   || ! "$PYC" -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
  say "installing $torch_req (with CUDA) and the test dependencies into $CV"
  t0=$SECONDS
  "$PYC" -m pip install -q "$torch_req" "pytest>=7" numpy safetensors
  "$PYC" -c "import torch, sys; sys.exit(torch.version.cuda is None)" \
    || die "$torch_req installed in $CV has no CUDA ($("$PYC" -c 'import torch; print(torch.__version__)'))"
  echo "$torch_req" > "$CV/.torch_requirement"
  say "installed in $((SECONDS - t0))s"
fi
torch_version="$("$PYC" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
# megatron-core, for the test that Megatron-Core loads our torch_dist export (it imports Triton: a
# CUDA torch; its wheel says Python >= 3.12, its pure-Python parts run here): unpacked, not installed.
# Where the index does not have it, that one test is skipped (said here).
MCORE="$CV/megatron_core-0.19.2"
if [ ! -d "$MCORE/megatron" ]; then
  rm -rf "$MCORE" "$CV/wheels" && mkdir -p "$CV/wheels"
  if "$PYC" -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: megatron-core==0.19.2 \
       -d "$CV/wheels" && "$PYC" -m pip install -q psutil \
     && "$PYC" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
       "$(ls "$CV"/wheels/megatron_core-*.whl)" "$MCORE"; then
    say "megatron-core 0.19.2 unpacked into $MCORE"
  else
    rm -rf "$MCORE"
    say "megatron-core 0.19.2 is not available: the test of Megatron-Core loading our export is skipped"
  fi
fi

arch_list="${MEGATRON_FSDP_CUDA_ARCH_LIST:-${TORCH_CUDA_ARCH_LIST:-9.0}}"
BUILD="$CV/megatron_fsdp_build"
stamp="$BUILD/stamp"
sources_hash="$(cat "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT"/csrc/* \
                    "$ROOT/megatron_fsdp/kernels/build_check.py" "$ROOT/megatron_fsdp/kernels/build_config.py" "$ROOT/scripts/cuda_build_check.sh" \
                  | sha256sum | cut -d' ' -f1) $torch_version $arch_list"
so="$(ls "$BUILD"/lib/megatron_fsdp/_C*.so 2>/dev/null | head -n 1 || true)"
if [ -n "$so" ] && [ "$(cat "$stamp" 2>/dev/null || true)" = "$sources_hash" ]; then
  say "csrc/ and setup.py unchanged: reusing $so"
else
  rm -rf "$BUILD/lib" "$stamp"
  mkdir -p "$BUILD"
  say "building the extension with CUDA (torch $torch_version, TORCH_CUDA_ARCH_LIST=$arch_list) into $BUILD/lib"
  t0=$SECONDS
  (
    cd "$ROOT"
    if [ "$arch_list" = default ]; then unset TORCH_CUDA_ARCH_LIST; else export TORCH_CUDA_ARCH_LIST="$arch_list"; fi
    unset MEGATRON_FSDP_NO_CUDA
    # build_ext, not an editable install: that would overwrite the checkout's megatron_fsdp/_C*.so.
    "$PYC" setup.py -q build_ext --build-lib "$BUILD/lib" --build-temp "$BUILD/temp"
  ) >"$BUILD/build.log" 2>&1 || {
    tail -n 60 "$BUILD/build.log" >&2
    die "the CUDA build failed (log: $BUILD/build.log)"
  }
  grep '^\[megatron_fsdp setup\]' "$BUILD/build.log" >&2 || true
  so="$(ls "$BUILD"/lib/megatron_fsdp/_C*.so 2>/dev/null | head -n 1 || true)"
  [ -n "$so" ] || die "the build produced no megatron_fsdp/_C*.so (log: $BUILD/build.log)"
  "$PYC" - "$so" <<'EOF' || die "the extension built with CUDA does not load or has no CUDA kernels"
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("megatron_fsdp._C", sys.argv[1])
ext = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ext)
assert ext.has_cuda, f"{sys.argv[1]} was built without its CUDA kernels"
EOF
  "$PYC" "$ROOT/megatron_fsdp/kernels/build_check.py" --so "$so" || die "the CUDA build is broken (above)"
  echo "$sources_hash" > "$stamp"
  say "built in $((SECONDS - t0))s: $so (has_cuda)"
fi

# The host-side tests of that build, under that torch, from a copy of the tree (tracked files and
# untracked ones git does not ignore) whose megatron_fsdp/_C*.so is a link to the CUDA build.
TREE="$BUILD/tree"
rm -rf "$TREE"
"$PYC" "$ROOT/scripts/copy_tree.py" "$TREE" --root "$ROOT" >/dev/null || die "could not copy the tree to $TREE (above)"
rm -f "$TREE"/megatron_fsdp/_C*.so "$TREE"/megatron_fsdp/_C*.json
ln -s "$so" "$TREE/megatron_fsdp/$(basename "$so")"
[ ! -f "$so.build.json" ] || ln -s "$so.build.json" "$TREE/megatron_fsdp/$(basename "$so").build.json"
tests=(tests/test_device_copy_kernels.py tests/test_copy_plan_cache.py tests/test_kernels.py tests/test_amax_kernel.py
       tests/test_fp8_cast_transpose.py tests/test_fsdp_copy_kernels.py
       tests/test_triton_activations.py tests/test_triton_rope.py tests/test_triton_bias_dropout_add.py
       tests/test_triton_cross_entropy.py  # Triton's interpreter
       tests/test_mcore_interchange.py::test_megatron_core_loads_our_export_with_the_same_logits)  # megatron-core
say "host-side tests of the CUDA build under torch $torch_version: ${tests[*]}"
t0=$SECONDS
(
  cd "$TREE"
  export PYTHONPATH="$TREE${MCORE:+:$MCORE}" MEGATRON_FSDP_REQUIRE_EXTENSION=1
  "$PYC" -c "
from megatron_fsdp import kernels
import os, sys
ext = kernels._load_extension()
assert kernels.extension_has_cuda(), f'the CUDA build is not the one imported: {ext}'
assert os.path.realpath(os.path.dirname(ext.__file__)) == os.path.realpath('megatron_fsdp'), ext.__file__
"
  # The Triton kernels compiled for sm_90 (ptxas on the host), in a process of its own without
  # Triton's interpreter, which the tests below run in (tests/conftest.py chooses it without a GPU).
  TRITON_INTERPRET=0 "$PYC" -m pytest -q -p no:cacheprovider tests/test_triton_compile.py
  "$PYC" -m pytest -q -p no:cacheprovider "${tests[@]}"
) || die "the host-side tests of the CUDA build failed (torch $torch_version)"
say "tests in $((SECONDS - t0))s; all done in ${SECONDS}s"
