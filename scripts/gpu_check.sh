#!/usr/bin/env bash
# One command for a machine with a CUDA GPU: build the extension with its CUDA
# kernels, run the CUDA tests, run the GPU benchmarks, print one table.
#
#   bash scripts/gpu_check.sh
#
# It uses the Python that has the CUDA torch ($PYTHON, default python3) as it
# is: no virtual environment, no pip, no network (a GPU image). The extension
# is built in place (megatron_fsdp/_C*.so) and the checkout is put first on
# PYTHONPATH. Needs torch with CUDA, nvcc (CUDA_HOME) and pytest; ninja makes
# the build parallel. Logs and JSON results go to $GPU_CHECK_OUT (default
# $OUT when set, else a new temporary directory).
#
# Any missing piece, failed or skipped CUDA test, or failed benchmark stops it
# with "GPU CHECK FAILED" and a non-zero exit; "GPU CHECK PASSED" is printed
# only when everything ran. Budget: 8 minutes (GPU_CHECK_BUDGET_S).
#
# benchmarks/bench_gpt_fp8.py, when present, runs last, without arguments,
# with the seconds left in GPU_CHECK_TIME_LEFT_S (it is killed after them); it
# must print one JSON object per result line (with a "case" key), like the
# other benchmarks.

set -Eeuo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$(command -v "${PYTHON:-python3}")"
OUT_DIR="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MEGATRON_FSDP_REQUIRE_EXTENSION=1
SECONDS=0
step="setup"

fail() {
  echo "GPU CHECK FAILED ($step, after ${SECONDS}s): $*" >&2
  echo "logs: $OUT_DIR" >&2
  exit 1
}
trap 'fail "command failed (line $LINENO)"' ERR

# Seconds left for a step, keeping `reserve` for the ones after it. Use as
# `limit="$(left N)"` (an assignment: a failure here stops the script).
left() {
  local reserve="$1" n=$((BUDGET_S - SECONDS - $1))
  [ "$n" -gt 10 ] || { echo "GPU CHECK FAILED ($step): out of time (budget ${BUDGET_S}s)" >&2; return 1; }
  echo "$n"
}

run_logged() {  # name timeout command...: output to $OUT_DIR/name.log, and the tail on failure
  local name="$1" limit="$2"
  shift 2
  echo "[gpu_check] $name (limit ${limit}s)" >&2
  if ! timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1; then
    tail -n 40 "$OUT_DIR/$name.log" >&2
    fail "$name failed or timed out (log: $OUT_DIR/$name.log)"
  fi
}

# ---- 1. what this machine has ----
step="preconditions"
command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: no NVIDIA driver"
nvidia-smi -L >"$OUT_DIR/gpus.txt" 2>&1 || fail "nvidia-smi -L: $(cat "$OUT_DIR/gpus.txt")"
"$PY" - >"$OUT_DIR/torch.txt" 2>&1 <<'EOF' || fail "$(tail -n 1 "$OUT_DIR/torch.txt")"
import torch
from torch.utils.cpp_extension import CUDA_HOME
assert torch.version.cuda, f"torch {torch.__version__} is built without CUDA"
assert torch.cuda.is_available(), f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
assert CUDA_HOME, "nvcc not found (set CUDA_HOME): the extension would build without its CUDA kernels"
import pytest  # noqa: F401  (the CUDA tests need it)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
      f"capability {torch.cuda.get_device_capability()}, nvcc in {CUDA_HOME}")
EOF
echo "[gpu_check] $(cat "$OUT_DIR/torch.txt")" >&2
[ -z "${MEGATRON_FSDP_NO_CUDA:-}" ] || fail "MEGATRON_FSDP_NO_CUDA is set: unset it to build the CUDA kernels"

# ---- 2. build the extension with CUDA, in place ----
step="build"
rm -f megatron_fsdp/_C*.so
limit="$(left 180)"
run_logged build "$limit" "$PY" setup.py build_ext --inplace
"$PY" - >"$OUT_DIR/extension.txt" 2>&1 <<'EOF' || fail "$(tail -n 1 "$OUT_DIR/extension.txt")"
import os
import megatron_fsdp
from megatron_fsdp import kernels
root = os.getcwd()
assert megatron_fsdp.__file__.startswith(root), f"imported {megatron_fsdp.__file__}, not the checkout in {root}"
assert kernels.extension_available(), f"extension does not import: {kernels.extension_import_error()}"
assert kernels.extension_has_cuda(), "the extension was built without CUDA (see build.log)"
print("extension with CUDA:", kernels._load_extension().__file__)
EOF
echo "[gpu_check] built in ${SECONDS}s: $(cat "$OUT_DIR/extension.txt")" >&2

# ---- 3. the CUDA tests (and the rest of the kernel test files) ----
step="tests"
limit="$(left 150)"
run_logged tests "$limit" "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT_DIR/tests.xml" \
  tests/test_device_copy_kernels.py tests/test_amax_kernel.py tests/test_kernels.py
"$PY" - "$OUT_DIR/tests.xml" >"$OUT_DIR/tests_summary.txt" 2>&1 <<'EOF' || fail "$(tail -n 1 "$OUT_DIR/tests_summary.txt")"
import sys
import xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
cuda = [c for c in cases if "cuda" in c.get("name", "").lower()]
skipped = [c.get("name") for c in cuda if c.find("skipped") is not None]
bad = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
assert not bad, f"failed: {bad}"
assert len(cuda) >= 20, f"only {len(cuda)} CUDA tests were collected"
assert not skipped, f"{len(skipped)} CUDA tests skipped on a CUDA machine, e.g. {skipped[:5]}"
print(f"{len(cases)} tests passed, {len(cuda)} of them on the GPU")
EOF
echo "[gpu_check] $(cat "$OUT_DIR/tests_summary.txt")" >&2

# ---- 4. benchmarks: JSON lines into $OUT_DIR/*.jsonl ----
step="benchmarks"
limit="$(left 120)"
run_logged bench_copy_in "$limit" "$PY" benchmarks/bench_copy_in.py --device cuda --repeats 20
grep '^{' "$OUT_DIR/bench_copy_in.log" >"$OUT_DIR/bench_copy_in.jsonl" || fail "bench_copy_in printed no results"
limit="$(left 90)"
run_logged bench_amax "$limit" "$PY" benchmarks/bench_amax.py --device cuda --repeats 30
grep '^{' "$OUT_DIR/bench_amax.log" >"$OUT_DIR/bench_amax.jsonl" || fail "bench_amax printed no results"
if [ -f benchmarks/bench_gpt_fp8.py ]; then
  limit="$(left 15)"
  GPU_CHECK_TIME_LEFT_S="$((limit - 5))" run_logged bench_gpt_fp8 "$limit" "$PY" benchmarks/bench_gpt_fp8.py
  grep '^{' "$OUT_DIR/bench_gpt_fp8.log" >"$OUT_DIR/bench_gpt_fp8.jsonl" || fail "bench_gpt_fp8 printed no results"
else
  echo "[gpu_check] benchmarks/bench_gpt_fp8.py not present: no GPT fp8 figures" >&2
fi

# ---- 5. one table ----
step="table"
"$PY" - "$OUT_DIR" <<'EOF'
import glob
import json
import os
import sys

# Each benchmark names its baseline and bound its own way: one column each here.
BASELINE = ("torch_ms", "foreach_ms", "bf16_ms")
BOUND = ("memcpy_ms", "bound_ms")
SPEEDUP = ("torch_over_ours", "foreach_over_ours", "speedup")
rows = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.jsonl"))):
    for line in open(path):
        rows.append(json.loads(line))
pick = lambda row, keys: next((row[k] for k in keys if k in row), "")  # noqa: E731
header = ["case", "ours ms", "baseline ms", "bound ms", "baseline/ours", "ours/bound", "ours GB/s", "bound GB/s",
          "other"]
known = {"case", "ours_ms", "ours_over_bound", "ours_gbps", "memcpy_gbps", "bound_gbps", *BASELINE, *BOUND, *SPEEDUP}
table = [header]
for r in rows:
    other = ", ".join(f"{k}={v}" for k, v in r.items() if k not in known)
    table.append([str(x) for x in (r.get("case", "?"), r.get("ours_ms", ""), pick(r, BASELINE), pick(r, BOUND),
                                    pick(r, SPEEDUP), r.get("ours_over_bound", ""), r.get("ours_gbps", ""),
                                    pick(r, ("memcpy_gbps", "bound_gbps")), other)])
widths = [max(len(row[i]) for row in table) for i in range(len(header))]
import datetime
print()
print(open(os.path.join(sys.argv[1], "torch.txt")).read().strip(), "|",
      datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
for i, row in enumerate(table):
    print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
    if i == 0:
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
EOF
echo "GPU CHECK PASSED in ${SECONDS}s (logs and JSON in $OUT_DIR)"
