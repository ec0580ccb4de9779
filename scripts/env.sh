# Creates (or reuses) the project's virtual environment and installs what
# megatron_fsdp needs. Sourced by the other scripts; sets $PY (and GPU_COUNT, the GPUs
# torch sees, for layout.sh).
#
#   MEGATRON_FSDP_VENV   where the environment lives (default: <repo>/.venv); `system`
#                        uses $PYTHON itself, with the torch it has (a GPU image with
#                        no network, say), and installs megatron_fsdp into it
#   PYTHON               the interpreter that creates it (default: python3)
#   MEGATRON_FSDP_TORCH  the torch requirement to install when none is present
#                        (default: torch==2.13.0 without a GPU, torch>=2.11,<2.15 with one:
#                        the range megatron_fsdp/_torch_compat.py supports)
#
# Offline: nothing is fetched when torch, pytest, numpy and safetensors are already
# there (with MEGATRON_FSDP_VENV=system: pip is left as it is, packages present are not
# reinstalled, the optional tokenizers and tensorboard are skipped when they cannot be
# installed, and the build is a PEP 660 editable install without build isolation).
#
# After a build, a child process checks that an error raised inside the extension
# arrives in Python as an exception (megatron_fsdp/kernels/build_check.py): a build by
# a compiler whose C++ runtime is not the one torch loads crashes instead, and stops
# here with the compiler named and the cure.

set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_FSDP_VENV:-$ROOT/.venv}"
system=0
if [ "$VENV" = system ]; then
  system=1
  PY="$(command -v "${PYTHON:-python3}")"
  VENV="$("$PY" -c 'import sys; print(sys.prefix)')"
else
  PY="$VENV/bin/python"
fi

if [ ! -x "$PY" ]; then
  echo "[env] creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
# pip 23.2 turns --no-build-isolation editable installs into isolated builds. A system
# Python's pip is not ours to upgrade (and may have no network): PEP 660 needs pip >= 21.3.
if [ "$system" = 0 ]; then
  if "$PY" -c "import pip, sys; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) >= (23, 3))"; then
    "$PY" -m pip install -q --upgrade pip
  fi
elif "$PY" -c "import pip, sys; sys.exit(tuple(map(int, pip.__version__.split('.')[:2])) >= (21, 3))"; then
  echo "[env] warning: this pip predates PEP 660 editable installs (pip >= 21.3)" >&2
fi

# One interpreter start answers "is torch there?", "which torch?" (the build's hash) and "how
# many GPUs does it see?" (GPU_COUNT, for layout.sh: each import of torch costs a second or more).
torch_probe() {
  torch_now="" GPU_COUNT=""
  { read -r torch_now; read -r GPU_COUNT; } < <("$PY" -c 'import torch; print(torch.__version__, torch.__file__)
print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null) || true
}
torch_probe
if [ -z "$torch_now" ]; then
  if [ -n "${MEGATRON_FSDP_TORCH:-}" ]; then
    torch_req="$MEGATRON_FSDP_TORCH"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    torch_req="torch>=2.11,<2.15"
  else
    # Pinned: a bare `torch` would pull a multi-GB CUDA build onto a CPU machine.
    torch_req="torch==2.13.0"
  fi
  echo "[env] installing $torch_req" >&2
  "$PY" -m pip install -q "$torch_req"
  torch_probe
  if [ -z "$torch_now" ]; then
    echo "[env] torch does not import after installing $torch_req" >&2
    exit 1
  fi
fi

# Prints those of the requirements given ("name" or "name>=version") that are not installed,
# or older than asked (versions compared by their leading numbers).
missing() {
  "$PY" - "$@" <<'EOF'
import importlib.metadata, importlib.util, re, sys

def numbers(version):
    return tuple(int(n) for n in re.match(r"[0-9.]*", version).group(0).strip(".").split(".") if n)

for req in sys.argv[1:]:
    name, _, least = req.partition(">=")
    if importlib.util.find_spec(name) is None:
        print(req)
    elif least:
        try:
            if numbers(importlib.metadata.version(name)) < numbers(least):
                print(req)
        except importlib.metadata.PackageNotFoundError:
            pass
EOF
}

# Reinstall only when the extension's sources, the build files or this file changed.
stamp="$VENV/.megatron_fsdp_build"
# The torch it builds against is part of it: another torch needs another build.
sources_hash="$(echo "$torch_now" |
                cat - "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT"/csrc/* "$ROOT/scripts/env.sh" \
                    "$ROOT/megatron_fsdp/kernels/build_check.py" "$ROOT/megatron_fsdp/kernels/build_config.py" | sha256sum | cut -d' ' -f1)"
# And the in-tree extension it built: another environment's env.sh (another torch) rebuilds that
# same megatron_fsdp/_C*.so, which this environment's torch would then refuse.
built_so() { cat "$ROOT"/megatron_fsdp/_C*.so 2>/dev/null | sha256sum | cut -d' ' -f1; }
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sources_hash $(built_so)" ] || ! ls "$ROOT"/megatron_fsdp/_C*.so >/dev/null 2>&1; then
  echo "[env] building megatron_fsdp and its C++ extension" >&2
  # Only what is missing: with everything present, no pip at all (offline images).
  # setuptools: pyproject's build requirement, which --no-build-isolation does not install; a
  # new Python 3.11 venv has 65.5, and torch 2.11 (setuptools<82) keeps it.
  required="$(missing "pytest>=7" numpy safetensors "setuptools>=70.1" | tr '\n' ' ')"
  if [ -n "$required" ]; then
    # Pinned to the installed torch's distribution version (torch.__version__ may carry a
    # "+cu130" that its metadata lacks): pip then stays within torch's own requirements.
    torch_dist="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
    if ! "$PY" -m pip install -q $required "torch==$torch_dist"; then
      echo "[env] could not install $required(no network? install them, then rerun)" >&2
      exit 1
    fi
  fi
  # tokenizers and tensorboard are optional at run time; the tests exercise both, and
  # transformers is the reference of the Hugging Face interchange tests (never a run-time need).
  optional="$(missing tokenizers tensorboard transformers | tr '\n' ' ')"
  if [ -n "$optional" ] && ! "$PY" -m pip install -q $optional; then
    [ "$system" = 1 ] || exit 1
    echo "[env] warning: could not install $optional(the tests that need them skip)" >&2
  fi
  (cd "$ROOT" && "$PY" -m pip install -q --no-build-isolation -e .)
  # Does an error raised in the new build arrive as an exception? (A C++ runtime mismatch crashes it.)
  if ! "$PY" "$ROOT/megatron_fsdp/kernels/build_check.py" --package-dir "$ROOT/megatron_fsdp"; then
    echo "[env] the extension just built is broken (above): fix the compiler and rerun" >&2
    exit 1
  fi
  echo "$sources_hash $(built_so)" > "$stamp"
fi
