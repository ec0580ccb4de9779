"""Sharded checkpoints with torch.distributed.checkpoint (Megatron's --ckpt-format torch_dcp).

Layout, Megatron's names:

    <save>/latest_checkpointed_iteration.txt     the tracker, written last
    <save>/iter_0000100/                          one checkpoint
        .metadata, __*_*.distcp                   DCP: model + optimizer, every rank its shards
        common.pt                                 iteration, scheduler, layout, caller's extra state
        rng/rank_00003.pt                         each rank's RNG states

A checkpoint is written into `iter_XXXXXXX.tmp-<id>` and renamed into place
only after every rank finished writing, and the tracker is replaced after
that: a save that dies part-way leaves the previous checkpoint as the latest
one. Loading reshards: DCP reads whatever shards the current model needs, so
a checkpoint saved at TP=2 x DP=2 loads at TP=1 x DP=2, TP=4 x DP=1 or on one
process. RNG states are restored only when the layout is the one saved.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from . import parallel_state
from .tensor_parallel import random as tp_random

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CKPT_FORMAT = "torch_dcp"
_FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _unwrap(model: nn.Module) -> nn.Module:
    from .distributed.data_parallel_base import _BaseDataParallel

    return model.module if isinstance(model, _BaseDataParallel) else model


def _inner_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_distributed() else 0


def _barrier() -> None:
    if _is_distributed():
        dist.barrier()


def _all_ranks_ok(ok: bool) -> bool:
    if not _is_distributed():
        return ok
    # On the device of the backend: an NCCL-only default group has no CPU path.
    device = parallel_state.get_device() if parallel_state.model_parallel_is_initialized() else None
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _broadcast_str(value: Optional[str]) -> str:
    if not _is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _layout() -> dict:
    if not parallel_state.model_parallel_is_initialized():
        return {"world_size": 1, "tensor_model_parallel_size": 1, "data_parallel_size": 1}
    return {
        "world_size": dist.get_world_size() if _is_distributed() else 1,
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "num_distributed_optimizer_instances": parallel_state.get_num_distributed_optimizer_instances(),
    }


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch_cpu": torch.get_rng_state(),
             "tracker": tp_random.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    tp_random.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _app_state(model: nn.Module, optimizer) -> dict:
    inner = _unwrap(model)
    state = {"model": get_model_state_dict(inner)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(inner, _inner_optimizer(optimizer))
    return state


# ---------------------------------------------------------------------- save


def save_checkpoint(iteration: int, model: nn.Module, optimizer=None, opt_param_scheduler=None,
                    save_dir: str = None, *, extra_state: Optional[dict] = None) -> str:
    """Save model, optimizer, scheduler, RNG states and `iteration` under
    `save_dir`; every rank writes its own shards. Returns the checkpoint's path.

    `extra_state` must hold plain Python values (it is loaded with
    torch.load(weights_only=True)).
    """
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
    if not save_dir:
        raise ValueError("save_dir is required")
    final = checkpoint_dir(save_dir, iteration)
    tmp, setup_error = None, None
    if _rank() == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
            os.makedirs(os.path.join(tmp, "rng"))
        except OSError as exc:
            setup_error = f"{type(exc).__name__}: {exc}"
    # The name, or rank 0's failure: every rank learns it and raises together.
    tmp = _broadcast_str(f"error:{setup_error}" if setup_error else tmp)
    if tmp.startswith("error:"):
        raise CheckpointError(f"saving checkpoint {final} failed on rank 0: {tmp[6:]}")

    state = _app_state(model, optimizer)
    try:
        dcp.save(state, checkpoint_id=tmp)
        error = None
    except (Exception, CheckpointException) as exc:  # DCP reports a failed rank to all ranks
        error = exc
    if error is None:
        try:
            torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{_rank():05d}.pt"))
            if _rank() == 0:
                common = {"iteration": iteration, "format": CKPT_FORMAT, "version": _FORMAT_VERSION,
                          "layout": _layout(),
                          "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler else None,
                          "extra_state": extra_state or {}}
                torch.save(common, os.path.join(tmp, "common.pt"))
        except Exception as exc:
            error = exc
    if not _all_ranks_ok(error is None):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint {final} failed"
            + (f" on this rank: {error}" if error else " on another rank") + "; the previous checkpoint is kept"
        ) from error

    publish_error = None
    if _rank() == 0:
        try:
            if os.path.exists(final):  # re-saving an iteration: swap, then drop the old copy
                old = f"{final}.old-{uuid.uuid4().hex[:12]}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _write_atomic(os.path.join(save_dir, TRACKER_FILENAME), f"{iteration}\n".encode())
        except OSError as exc:
            publish_error = exc
    if not _all_ranks_ok(publish_error is None):
        raise CheckpointError(f"publishing checkpoint {final} failed on rank 0: {publish_error or 'see rank 0'}")
    return final


# ---------------------------------------------------------------------- load


def read_latest_iteration(load_dir: str) -> Optional[int]:
    """The iteration the tracker names, or None when `load_dir` has no checkpoint."""
    tracker = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number")
    return int(text)


def _global_shape(t: Any) -> Optional[tuple]:
    if isinstance(t, torch.Tensor):
        return tuple(t.shape)  # a DTensor's shape is its global shape
    return None


def _check_fits(path: str, state: dict) -> None:
    """Compare the checkpoint's tensor shapes with the model's before reading any data."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: cannot read its "
                              f"metadata ({exc})") from exc
    saved = metadata.state_dict_metadata
    problems = []
    for key, value in state["model"].items():
        fqn = f"model.{key}"
        if fqn not in saved:
            problems.append(f"{key}: missing from the checkpoint")
            continue
        want = _global_shape(value)
        have = tuple(getattr(saved[fqn], "size", ()) or ())
        if want is not None and want != have:
            problems.append(f"{key}: checkpoint has shape {list(have)}, model has {list(want)}")
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.")
                   and k[len("model."):] not in state["model"])
    problems += [f"{k}: in the checkpoint but not in the model" for k in extra]
    if problems:
        shown = "\n  ".join(problems[:10]) + ("\n  ..." if len(problems) > 10 else "")
        raise CheckpointError(f"checkpoint {path} does not fit the model:\n  {shown}")


def load_checkpoint(model: nn.Module, optimizer=None, opt_param_scheduler=None, load_dir: str = None, *,
                    iteration: Optional[int] = None, load_optim: bool = True, load_rng: bool = True) -> dict:
    """Load the latest checkpoint (or `iteration`) from `load_dir` into the
    model, optimizer and scheduler, resharding to the current layout.

    Returns {"iteration": int, "extra_state": dict, "rng_restored": bool}.
    Raises CheckpointError (on every rank) when there is nothing to load, the
    checkpoint is incomplete, or it does not fit the model.
    """
    if not load_dir:
        raise ValueError("load_dir is required")
    if iteration is None:
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            raise CheckpointError(f"no checkpoint in {load_dir}: {TRACKER_FILENAME} not found")
    path = checkpoint_dir(load_dir, iteration)
    common_path = os.path.join(path, "common.pt")
    if not os.path.isfile(common_path):
        raise CheckpointError(f"checkpoint {path} is missing or incomplete (no common.pt)")
    try:
        common = torch.load(common_path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: common.pt is corrupt ({exc})") from exc
    if common.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {common.get('format')!r}, expected {CKPT_FORMAT!r}")

    state = _app_state(model, optimizer if load_optim else None)
    _check_fits(path, state)
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {exc}") from exc
    inner = _unwrap(model)
    set_model_state_dict(inner, state["model"], options=StateDictOptions(strict=True))
    if load_optim and optimizer is not None:
        set_optimizer_state_dict(inner, _inner_optimizer(optimizer), state["optimizer"])
    if opt_param_scheduler is not None and common["opt_param_scheduler"] is not None:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])

    rng_restored = False
    if load_rng and common["layout"] == _layout():
        rng_path = os.path.join(path, "rng", f"rank_{_rank():05d}.pt")
        if os.path.isfile(rng_path):
            _set_rng_state(torch.load(rng_path, weights_only=True))
            rng_restored = True
    rng_restored = _all_ranks_ok(rng_restored)
    return {"iteration": common["iteration"], "extra_state": common["extra_state"], "rng_restored": rng_restored}


# ---------------------------------------------------------------------- export

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@torch.no_grad()
def export_safetensors(model: nn.Module, path: str, dtype: torch.dtype = torch.float32) -> None:
    """Write the full, unsharded weights to one safetensors file on rank 0.

    Parameters are gathered one at a time and streamed to the file (the
    header is computed from the global shapes up front), so no rank holds
    more than one full parameter beyond its shards. Written aside and renamed.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {list(_SAFETENSORS_DTYPES)}, got {dtype}")
    inner = _unwrap(model)
    state = inner.state_dict()
    header, offset = {}, 0
    for name, t in state.items():
        nbytes = t.numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "producer": "megatron_fsdp"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # keep the data 8-byte aligned

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}" if _rank() == 0 else None
    error = None
    f = None
    try:
        if tmp is not None:
            f = open(tmp, "wb")
            f.write(len(header_bytes).to_bytes(8, "little"))
            f.write(header_bytes)
    except OSError as exc:
        error, f = exc, None
    for t in state.values():
        # Every rank joins every gather, even after a write failed on rank 0,
        # so that no rank is left waiting in a collective.
        full = t.full_tensor() if isinstance(t, DTensor) else t
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
    if not _all_ranks_ok(error is None):
        if tmp and os.path.exists(tmp):
            os.remove(tmp)
        raise CheckpointError(f"exporting {path} failed: {error or 'on another rank'}") from error
    if tmp:
        os.replace(tmp, path)
    _barrier()
