"""Our copy kernels installed as FSDP2's `fsdp::` copy ops.

FSDP2 packs shards before each all-gather (`fsdp::all_gather_copy_in`),
unpacks after it (`fsdp::split_with_sizes_copy`) and packs gradients before
each reduce-scatter (`fsdp::chunk_cat`). `enable_fsdp_copy_kernels()`
registers our C++ implementations (csrc/bindings.cpp) for those ops on CPU,
and on CUDA when the extension was built with it, after checking that the
running torch declares exactly the schemas we implement; with any other
torch it warns once and leaves torch's path alone. Nothing installs them
unless asked: `TorchFullyShardedDataParallelConfig(fsdp_copy_kernels=True)`
(pretrain()'s --torch-fsdp2-copy-kernels) or a direct call. The registration
is process-wide, as the op registry is, so every `fully_shard` module of the
process then runs them; `disable_fsdp_copy_kernels()` removes it and torch's
kernels serve again. Results are bitwise those of torch's ops, except the payload of
NaNs cast to bf16 on CPU (still NaN; see docs/fsdp.md, Copy kernels). Where ours serve an op, the
profiler shows a `megatron_fsdp::<op>` range inside torch's `fsdp::<op>`.

Under mixed precision the cast of each fp32 shard to the all-gather dtype is
fused into the copy-in (see fsdp_mixed_precision_hook, installed with the
kernels).
"""

from __future__ import annotations

import threading
import warnings

import torch

from .. import _torch_compat
from . import fsdp_mixed_precision_hook
from .extension import _load_extension, extension_available

# The schemas we implement (torch 2.9-2.14 declare them so): the compatibility module's pin.
EXPECTED_SCHEMAS = _torch_compat.FSDP_COPY_OP_SCHEMAS

_lock = threading.Lock()
_installed = False
_warned = False


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
    training; the raw `fully_shard` user's one call (the FSDP wrapper makes it
    when its config has `fsdp_copy_kernels=True`).
    """
    global _installed, _warned
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


def disable_fsdp_copy_kernels() -> None:
    """Remove our registrations; torch's kernels serve the fsdp:: ops again."""
    global _installed
    with _lock:
        fsdp_mixed_precision_hook.uninstall()
        if _installed:
            _load_extension().uninstall_fsdp_kernels()
            _installed = False
