"""Export of the full, unsharded weights to one safetensors file."""

from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist
from torch import nn

from .. import parallel_state
from ..tensor_parallel import partition_stride
from .core import CheckpointError
from .hf_directory import safetensors_header
from .publish import fsync_dir
from ..utils import all_gather_objects, get_rank_safe, is_distributed, unwrap_model


def _all_ok(ok: bool) -> bool:
    return all(all_gather_objects(ok))


_EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@torch.no_grad()
def export_safetensors(model: nn.Module, path: str, dtype: torch.dtype = torch.float32) -> None:
    """Write the full, unsharded weights to one safetensors file on rank 0.

    Parameters are gathered one at a time and streamed to the file (the
    header is computed from the global shapes up front), so no rank holds
    more than one full parameter beyond its shards. Written aside and renamed.

    A gated MLP's `linear_fc1` weight (and bias) is written in Megatron's
    TP=1 layout, `[gate; up]`: the gate rows, then the up rows, which is what
    Megatron-to-HF converters split in halves, whatever the TP size
    (tensor_parallel.partition_stride).
    """
    if dtype not in _EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {list(_EXPORT_DTYPES)}, got {dtype}")
    inner = unwrap_model(model)
    # Weights only: module extra state (fp8 scaling histories) is no tensor to export.
    state = {name: t for name, t in inner.state_dict().items() if isinstance(t, torch.Tensor)}
    strided, tp = partition_stride.strided_parameters(inner), parallel_state.get_tensor_model_parallel_world_size()
    # From the global shapes, up front: the data follows as each parameter is gathered.
    header = safetensors_header({name: (t.shape, dtype) for name, t in state.items()}, {"producer": "megatron_fsdp"})

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}" if get_rank_safe() == 0 else None
    error, f = None, None
    try:
        if tmp is not None:
            f = open(tmp, "wb")
            f.write(header)
    except OSError as exc:
        error, f = exc, None
    for name, t in state.items():
        # Every rank joins every gather, even after a write failed on rank 0,
        # so that no rank is left waiting in a collective.
        full = partition_stride.full_value(t, strided.get(name, 1), tp)
        if f is not None:
            try:
                f.write(full.detach().to("cpu", dtype).contiguous().view(torch.uint8).numpy().tobytes())
            except OSError as exc:
                error = exc
                f.close()
                f = None
        del full
    if f is not None:
        try:
            f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            error = exc
        finally:
            f.close()
    if not _all_ok(error is None):
        if tmp and os.path.exists(tmp):
            os.remove(tmp)
        raise CheckpointError(f"exporting {path} failed: {error or 'on another rank'}") from error
    if tmp:
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    if is_distributed():
        dist.barrier()
