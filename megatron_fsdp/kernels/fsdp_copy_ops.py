"""Our copy kernels installed as FSDP2's `fsdp::` copy ops.

FSDP2 packs shards before each all-gather (`fsdp::all_gather_copy_in`),
unpacks after it (`fsdp::split_with_sizes_copy`) and packs gradients before
each reduce-scatter (`fsdp::chunk_cat`). `enable_fsdp_copy_kernels()`
registers our C++ implementations (csrc/bindings.cpp) for those ops on CPU,
and on CUDA when the extension was built with it, after checking that the
running torch declares exactly the schemas we implement; with any other
torch it warns once and leaves torch's path alone. The registration is
process-wide, as the op registry is; `disable_fsdp_copy_kernels()` removes it
and torch's kernels serve again. Results are bitwise those of torch's ops, except the payload of
NaNs cast to bf16 on CPU (still NaN; see README). Where ours serve an op, the
profiler shows a `megatron_fsdp::<op>` range inside torch's `fsdp::<op>`.

Under mixed precision the cast of each fp32 shard to the all-gather dtype is
fused into the copy-in (see fsdp_mixed_precision_hook, installed with the
kernels).
"""

from __future__ import annotations

import os
import threading
import warnings

import torch

from .. import _torch_compat
from . import _load_extension, extension_available, fsdp_mixed_precision_hook

# The schemas we implement (torch 2.9-2.14 declare them so): the compatibility module's pin.
EXPECTED_SCHEMAS = _torch_compat.FSDP_COPY_OP_SCHEMAS

_lock = threading.Lock()
_installed = False
_warned = False
# The process-level switch: None until decided, then True/False. The
# environment variable MEGATRON_FSDP_COPY_KERNELS=0 turns the default off;
# enable_/disable_fsdp_copy_kernels() decide it explicitly.
_wanted: bool | None = None


def schema_mismatches() -> dict[str, str]:
    """Ops whose schema in the running torch differs from the one we implement."""
    found = {}
    for name, expected in EXPECTED_SCHEMAS.items():
        actual = _torch_compat.fsdp_copy_op_schema(name)
        if actual != expected:
            found[name] = actual
    return found


def fsdp_copy_kernels_enabled() -> bool:
    return _installed


def enable_fsdp_copy_kernels() -> bool:
    """Install our kernels for FSDP2's copy ops; returns whether they are active.

    Falls back to torch's own ops, with one warning, when the extension is not
    built or this torch declares different schemas. Call it once, before
    training; the raw `fully_shard` user's one call.
    """
    global _installed, _warned, _wanted
    _wanted = True
    with _lock:
        if _installed:
            return True
        problem = None
        if not extension_available():
            problem = "the megatron_fsdp extension is not built"
        else:
            mismatched = schema_mismatches()
            if mismatched:
                problem = f"torch {torch.__version__} declares other schemas: {mismatched}"
        if problem:
            if not _warned:
                warnings.warn(f"megatron_fsdp copy kernels disabled, torch's FSDP copy path runs: {problem}",
                              RuntimeWarning, stacklevel=2)
                _warned = True
            return False
        # C++ implementations: a Python one would turn the op's tensor list
        # back into Python objects on every call.
        _load_extension().install_fsdp_kernels()
        _installed = True
        if not fsdp_mixed_precision_hook.install():
            warnings.warn(f"torch {torch.__version__} changed FSDP2's all-gather input functions: the "
                          "mixed-precision cast stays a separate pass", RuntimeWarning, stacklevel=2)
        return True


def install_fsdp_copy_kernels_by_default() -> bool:
    """What the FSDP wrapper calls: install the kernels unless this process
    turned them off (`disable_fsdp_copy_kernels()` or the environment variable
    MEGATRON_FSDP_COPY_KERNELS=0). Returns whether they serve."""
    wanted = _wanted
    if wanted is None:
        wanted = os.environ.get("MEGATRON_FSDP_COPY_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")
    return enable_fsdp_copy_kernels() if wanted else False


def disable_fsdp_copy_kernels() -> None:
    """Remove our registrations; torch's kernels serve the fsdp:: ops again,
    and the FSDP wrapper leaves them off in this process."""
    global _installed, _wanted
    _wanted = False
    with _lock:
        fsdp_mixed_precision_hook.uninstall()
        if _installed:
            _load_extension().uninstall_fsdp_kernels()
            _installed = False
