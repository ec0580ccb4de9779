"""Our copy kernels installed as FSDP2's `fsdp::` copy ops.

FSDP2 packs shards before each all-gather (`fsdp::all_gather_copy_in`),
unpacks after it (`fsdp::split_with_sizes_copy`) and packs gradients before
each reduce-scatter (`fsdp::chunk_cat`). `enable_fsdp_copy_kernels()`
registers our implementations for those ops on CPU (and the copy-in on CUDA
when the extension was built with it), after checking that the running torch declares
exactly the schemas we implement; with any other torch it warns once and
leaves torch's path alone. The registration is process-wide, as the op
registry is; `disable_fsdp_copy_kernels()` removes it and torch's kernels
serve again. Results are bitwise those of torch's ops.

Under mixed precision the cast of each fp32 shard to the all-gather dtype is
fused into the copy-in (see fsdp_mixed_precision_hook, installed with the
kernels).
"""

from __future__ import annotations

import collections
import threading
import warnings
from typing import Optional

import torch

from . import _load_extension, extension_available, extension_has_cuda, fsdp_mixed_precision_hook, pack_into

# The schemas as torch 2.9-2.14 declare them (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
EXPECTED_SCHEMAS = {
    "all_gather_copy_in": "fsdp::all_gather_copy_in(Tensor[] all_gather_inputs, Tensor all_gather_output, "
                          "SymInt[] inp_split_sizes, SymInt all_gather_input_numel, SymInt rank) -> (Tensor, Tensor)",
    "split_with_sizes_copy": "fsdp::split_with_sizes_copy(Tensor all_gather_output, SymInt[] "
                             "all_gather_input_split_sizes, int dim=0, *, Tensor(a!)[] out) -> ()",
    "chunk_cat": "fsdp::chunk_cat(Tensor[] tensors, int dim, int num_chunks, *, Tensor(a!) out) -> ()",
}

# How often each of our kernels ran (by op name): lets tests and users see them work.
calls: collections.Counter = collections.Counter()

_lock = threading.Lock()
_library: Optional[torch.library.Library] = None
_warned = False


def _all_gather_copy_in(all_gather_inputs, all_gather_output, inp_split_sizes, all_gather_input_numel, rank):
    calls["all_gather_copy_in"] += 1
    all_gather_input = all_gather_output.narrow(0, all_gather_input_numel * rank, all_gather_input_numel)
    with torch.no_grad():
        pack_into(all_gather_inputs, all_gather_input)
    return all_gather_input, all_gather_output


def _split_with_sizes_copy(all_gather_output, all_gather_input_split_sizes, dim=0, *, out):
    if dim != 1 or all_gather_output.dim() != 2 or not all_gather_output.is_contiguous():
        # FSDP2 always splits a contiguous [world_size, n] buffer along dim 1.
        torch.split_with_sizes_copy(all_gather_output, all_gather_input_split_sizes, dim=dim, out=out)
        return
    calls["split_with_sizes_copy"] += 1
    # Registered for CPU only; the direct entry point skips per-tensor boxing.
    _load_extension().split_copy_out_cpu(all_gather_output, list(all_gather_input_split_sizes), out)


def _chunk_cat(tensors, dim, num_chunks, *, out):
    if dim != 0 or out.dim() != 2 or not out.is_contiguous() or len({t.dtype for t in tensors}) > 1:
        torch._chunk_cat(tensors, dim, num_chunks, out=out)  # torch's own checks and errors
        return
    calls["chunk_cat"] += 1
    _load_extension().chunk_cat_cpu(tensors, num_chunks, out)  # registered for CPU only


def schema_mismatches() -> dict[str, str]:
    """Ops whose schema in the running torch differs from the one we implement."""
    found = {}
    for name, expected in EXPECTED_SCHEMAS.items():
        try:
            # Importing FSDP registers the fsdp:: ops.
            import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401

            actual = str(getattr(torch.ops.fsdp, name).default._schema)
        except (AttributeError, ImportError, RuntimeError) as exc:
            actual = f"<missing: {exc}>"
        if actual != expected:
            found[name] = actual
    return found


def fsdp_copy_kernels_enabled() -> bool:
    return _library is not None


def enable_fsdp_copy_kernels() -> bool:
    """Install our kernels for FSDP2's copy ops; returns whether they are active.

    Falls back to torch's own ops, with one warning, when the extension is not
    built or this torch declares different schemas. Call it once, before
    training; the raw `fully_shard` user's one call.
    """
    global _library, _warned
    with _lock:
        if _library is not None:
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
        library = torch.library.Library("fsdp", "IMPL")
        with warnings.catch_warnings():
            # torch notes that we override its kernels: that is the point.
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            library.impl("all_gather_copy_in", _all_gather_copy_in, "CPU")
            library.impl("split_with_sizes_copy", _split_with_sizes_copy, "CPU")
            library.impl("chunk_cat", _chunk_cat, "CPU")
            if extension_has_cuda():  # only pack_into has a CUDA kernel so far
                library.impl("all_gather_copy_in", _all_gather_copy_in, "CUDA")
        _library = library
        if not fsdp_mixed_precision_hook.install():
            warnings.warn(f"torch {torch.__version__} changed FSDP2's all-gather input functions: the "
                          "mixed-precision cast stays a separate pass", RuntimeWarning, stacklevel=2)
        return True


def disable_fsdp_copy_kernels() -> None:
    """Remove our registrations; torch's kernels serve the fsdp:: ops again."""
    global _library
    with _lock:
        fsdp_mixed_precision_hook.uninstall()
        if _library is not None:
            _library._destroy()
            _library = None
