#!/usr/bin/env bash
# Runs the whole test suite (CPU, gloo worker processes). Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# The suite must exercise the compiled extension, not its Python fallback.
export MEGATRON_FSDP_REQUIRE_EXTENSION=1
exec "$PY" -m pytest -q tests "$@"
