# Creates (or reuses) the project's virtual environment and installs what
# megatron_fsdp needs. Sourced by the other scripts; sets $PY.
#
#   MEGATRON_FSDP_VENV   where the environment lives (default: <repo>/.venv); `system`
#                        uses $PYTHON itself, with the torch it has (a GPU image with
#                        no network, say), and installs megatron_fsdp into it
#   PYTHON               the interpreter that creates it (default: python3)
#   MEGATRON_FSDP_TORCH  the torch requirement to install when none is present
#                        (default: torch==2.13.0 without a GPU, torch>=2.11 with one)

set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_FSDP_VENV:-$ROOT/.venv}"
if [ "$VENV" = system ]; then
  PY="$(command -v "${PYTHON:-python3}")"
  VENV="$("$PY" -c 'import sys; print(sys.prefix)')"
else
  PY="$VENV/bin/python"
fi

if [ ! -x "$PY" ]; then
  echo "[env] creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# pip 23.2 turns --no-build-isolation editable installs into isolated builds.
if "$PY" -c "import pip, sys; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) >= (23, 3))"; then
  "$PY" -m pip install -q --upgrade pip
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  if [ -n "${MEGATRON_FSDP_TORCH:-}" ]; then
    torch_req="$MEGATRON_FSDP_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_req="torch>=2.11"
  else
    # Pinned: a bare `torch` would pull a multi-GB CUDA build onto a CPU machine.
    torch_req="torch==2.13.0"
  fi
  echo "[env] installing $torch_req" >&2
  "$PY" -m pip install -q "$torch_req"
fi

# Reinstall only when the extension's sources, the build script or this file changed.
stamp="$VENV/.megatron_fsdp_build"
sources_hash="$(cat "$ROOT/setup.py" "$ROOT"/csrc/* "$ROOT/scripts/env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sources_hash" ] || ! ls "$ROOT"/megatron_fsdp/_C*.so >/dev/null 2>&1; then
  echo "[env] building megatron_fsdp and its C++ extension" >&2
  # tokenizers and tensorboard are optional at run time; the tests exercise both.
  "$PY" -m pip install -q "pytest>=7" numpy safetensors tokenizers tensorboard
  (cd "$ROOT" && "$PY" -m pip install -q --no-build-isolation -e .)
  echo "$sources_hash" > "$stamp"
fi
