"""Sharded checkpoints with torch.distributed.checkpoint (Megatron's --ckpt-format torch_dcp).

Layout, Megatron's names:

    <save>/latest_checkpointed_iteration.txt     the tracker, written last
    <save>/iter_0000100/                          one checkpoint
        .metadata, __*_*.distcp                   DCP: model + optimizer, every rank its shards
        common.pt                                 iteration, scheduler, layout, caller's extra state
        rng/rank_00003.pt                         each rank's RNG states

A checkpoint is written into `iter_XXXXXXX.tmp-<run>-<id>` and renamed into
place only after every rank finished writing, and the tracker is replaced
after that (each rename followed by an fsync of the directory): a save that
dies part-way leaves the previous checkpoint as the latest one. Re-saving an
iteration first renames the existing copy to `iter_XXXXXXX.old-<run>-<id>`,
which loading falls back to until the new copy is in place. The next save of
a later run removes what crashed saves left behind.

Loading reshards: DCP reads whatever shards the current model needs, so a
checkpoint saved at TP=2 x DP=2 loads at TP=1 x DP=2, TP=4 x DP=1 or on one
process. RNG states are restored only when the layout is the one saved.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import uuid
from typing import Optional

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
# Names this process's temporary and set-aside directories. Only rank 0
# creates them, so it identifies the job: a later run (or a restart) can
# tell what earlier runs' crashed saves left from what its own saves hold.
_RUN_ID = uuid.uuid4().hex[:8]
_ASIDE = re.compile(r"(iter_\d{7})\.(tmp|old)-(.+)")


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


def _describe(exc: BaseException) -> str:
    """One line per failing rank: DCP's own message is whole tracebacks."""
    if not isinstance(exc, CheckpointException):
        return f"{type(exc).__name__}: {exc}"
    lines = []
    for rank, failure in sorted(exc.failures.items()):
        cause = failure[0] if isinstance(failure, tuple) else failure
        lines.append(f"rank {rank}: {type(cause).__name__}: {cause}")
    return "; ".join(lines) or "DCP reported a failure without details"


def _fsync_dir(path: str) -> None:
    """Make renames and new entries in `path` durable (POSIX needs the directory synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Filesystems that cannot sync a directory offer nothing stronger to ask for.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _write_durable(path: str, write) -> None:
    """`write(file)`, then flushed and fsynced: on disk before the caller renames it."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    _write_durable(tmp, lambda f: f.write(data))
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


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


def _optimizer_owner(inner: nn.Module, optimizer) -> nn.Module:
    # With fp32 main params the optimizer steps those, not the model's
    # parameters: DCP names its state through a mirror holding them.
    return optimizer.main_params_module(inner) if hasattr(optimizer, "main_params_module") else inner


def _app_state(model: nn.Module, optimizer, main_params: bool = True) -> dict:
    inner = _unwrap(model)
    state = {"model": get_model_state_dict(inner)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(_optimizer_owner(inner, optimizer),
                                                      _inner_optimizer(optimizer))
        if main_params and getattr(optimizer, "has_main_params", False):
            state["main_params"] = optimizer.main_params_state_dict(inner)
    return state


# ---------------------------------------------------------------------- save


def _clean_stale(save_dir: str) -> None:
    """Remove what crashed saves of earlier runs left in `save_dir` (runs on
    rank 0 only). This run's own names belong to a save in progress. A
    set-aside copy whose iteration directory is missing is the checkpoint
    (the crash came between the two renames of a re-save): it is put back."""
    for entry in sorted(os.listdir(save_dir)):
        match = _ASIDE.fullmatch(entry)
        if match is None or match.group(3).startswith(f"{_RUN_ID}-"):
            continue
        path, final = os.path.join(save_dir, entry), os.path.join(save_dir, match.group(1))
        if (match.group(2) == "old" and not os.path.exists(final)
                and os.path.isfile(os.path.join(path, "common.pt"))):
            os.replace(path, final)
            _fsync_dir(save_dir)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _publish(save_dir: str, tmp: str, final: str, iteration: int) -> None:
    """Rename `tmp` to `final` and point the tracker at it. An existing
    `final` is set aside first and removed last: until the new copy is in
    place, loading finds the set-aside one, so the tracker never names an
    iteration without a complete checkpoint."""
    _fsync_dir(os.path.join(tmp, "rng"))
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{_RUN_ID}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:
            os.replace(old, final)
        raise
    _fsync_dir(save_dir)
    _write_atomic(os.path.join(save_dir, TRACKER_FILENAME), f"{iteration}\n".encode())
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
            _clean_stale(save_dir)
            tmp = f"{final}.tmp-{_RUN_ID}-{uuid.uuid4().hex[:8]}"
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
            rng_state = _rng_state()
            _write_durable(os.path.join(tmp, "rng", f"rank_{_rank():05d}.pt"), lambda f: torch.save(rng_state, f))
            if _rank() == 0:
                common = {"iteration": iteration, "format": CKPT_FORMAT, "version": _FORMAT_VERSION,
                          "layout": _layout(),
                          "opt_param_scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler else None,
                          "extra_state": extra_state or {}}
                _write_durable(os.path.join(tmp, "common.pt"), lambda f: torch.save(common, f))
        except Exception as exc:
            error = exc
    if not _all_ranks_ok(error is None):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint {final} failed"
            + (f" on this rank: {_describe(error)}" if error else " on another rank")
            + "; the previous checkpoint is kept"
        ) from error

    publish_error = None
    if _rank() == 0:
        try:
            _publish(save_dir, tmp, final, iteration)
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


def _find_checkpoint(load_dir: str, iteration: int) -> str:
    """The directory holding `iteration`: its own, or, while a re-save of it
    is between its two renames (or crashed there), the set-aside copy."""
    path = checkpoint_dir(load_dir, iteration)
    if os.path.isfile(os.path.join(path, "common.pt")):
        return path
    name = os.path.basename(path)
    aside = [os.path.join(load_dir, e) for e in os.listdir(load_dir) if e.startswith(f"{name}.old-")
             and os.path.isfile(os.path.join(load_dir, e, "common.pt"))]
    return max(aside, key=os.path.getmtime) if aside else path


def _check_fits(path: str, saved: dict, state: dict) -> None:
    """Compare the checkpoint's tensor shapes with the model's before reading any data."""
    problems = []
    for key, value in state["model"].items():
        fqn = f"model.{key}"
        if fqn not in saved:
            problems.append(f"{key}: missing from the checkpoint")
            continue
        want = tuple(value.shape) if isinstance(value, torch.Tensor) else None  # DTensor: the global shape
        have = tuple(getattr(saved[fqn], "size", ()) or ())
        if want is not None and want != have:
            problems.append(f"{key}: checkpoint has shape {list(have)}, model has {list(want)}")
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.")
                   and k[len("model."):] not in state["model"])
    problems += [f"{k}: in the checkpoint but not in the model" for k in extra]
    if problems:
        shown = "\n  ".join(problems[:10]) + ("\n  ..." if len(problems) > 10 else "")
        raise CheckpointError(f"checkpoint {path} does not fit the model:\n  {shown}")


def _read_checkpoint(path: str, optimizer, opt_param_scheduler, load_optim: bool) -> tuple[dict, dict]:
    """common.pt and the DCP metadata's keys, checked against what is to be
    loaded before any collective read."""
    common_path = os.path.join(path, "common.pt")
    if not os.path.isfile(common_path):
        raise CheckpointError(f"checkpoint {path} is missing or incomplete (no common.pt)")
    try:
        common = torch.load(common_path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: common.pt is corrupt ({exc})") from exc
    if common.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {common.get('format')!r}, expected {CKPT_FORMAT!r}")
    try:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: cannot read its "
                              f"metadata ({exc})") from exc
    if load_optim and optimizer is not None and not any(k.startswith("optimizer.") for k in saved):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (it was saved without an "
                              "optimizer): load it with load_optim=False (--no-load-optim)")
    if load_optim and opt_param_scheduler is not None and common.get("opt_param_scheduler") is None:
        raise CheckpointError(f"checkpoint {path} holds no learning-rate scheduler state: load it with "
                              "load_optim=False (--no-load-optim), or without a scheduler")
    return common, saved


def load_checkpoint(model: nn.Module, optimizer=None, opt_param_scheduler=None, load_dir: str = None, *,
                    iteration: Optional[int] = None, load_optim: bool = True, load_rng: bool = True) -> dict:
    """Load the latest checkpoint (or `iteration`) from `load_dir` into the
    model, optimizer and scheduler, resharding to the current layout.

    As in Megatron, `load_optim=False` (--no-load-optim) loads neither the
    optimizer nor the scheduler, and refreshes fp32 main params from the
    loaded model. Returns {"iteration": int, "extra_state": dict,
    "rng_restored": bool}. Raises CheckpointError (on every rank, before any
    collective read) when there is nothing to load, the checkpoint is
    incomplete, lacks state that was asked for, or does not fit the model.
    """
    if not load_dir:
        raise ValueError("load_dir is required")
    if iteration is None:
        iteration = read_latest_iteration(load_dir)
        if iteration is None:
            raise CheckpointError(f"no checkpoint in {load_dir}: {TRACKER_FILENAME} not found")
    path = _find_checkpoint(load_dir, iteration)
    state, error = None, None
    try:
        common, saved = _read_checkpoint(path, optimizer, opt_param_scheduler, load_optim)
        state = _app_state(model, optimizer if load_optim else None,
                           main_params=any(k.startswith("main_params.") for k in saved))
        _check_fits(path, saved, state)
        rng_path = os.path.join(path, "rng", f"rank_{_rank():05d}.pt")
        restore_rng = load_rng and common["layout"] == _layout()
        if restore_rng and not os.path.isfile(rng_path):
            raise CheckpointError(f"checkpoint {path} has no RNG state for rank {_rank()}: load it with "
                                  "load_rng=False (--no-load-rng)")
    except CheckpointError as exc:
        error = exc
    # Files can differ between ranks' views (the RNG files do): agree first.
    if not _all_ranks_ok(error is None):
        raise error or CheckpointError(f"checkpoint {path} cannot be loaded: see the error on another rank")
    try:
        dcp.load(state, checkpoint_id=path)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"checkpoint {path} is incomplete or corrupt: {_describe(exc)}") from exc
    inner = _unwrap(model)
    set_model_state_dict(inner, state["model"], options=StateDictOptions(strict=True))
    if optimizer is not None and "main_params" not in state and hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()
    if load_optim and optimizer is not None:
        set_optimizer_state_dict(_optimizer_owner(inner, optimizer), _inner_optimizer(optimizer), state["optimizer"])
    if load_optim and opt_param_scheduler is not None:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])

    if restore_rng:
        _set_rng_state(torch.load(rng_path, weights_only=True))
    return {"iteration": common["iteration"], "extra_state": common["extra_state"], "rng_restored": restore_rng}


# ---------------------------------------------------------------------- export

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


@torch.no_grad()
def export_safetensors(model: nn.Module, path: str, dtype: torch.dtype = torch.float32) -> None:
    """Write the full, unsharded weights to one safetensors file on rank 0.

    Parameters are gathered one at a time and streamed to the file (the
    header is computed from the global shapes up front), so no rank holds
    more than one full parameter beyond its shards. Written aside and renamed.

    A gated MLP's `linear_fc1` weight (and bias) is written in Megatron's
    TP=1 layout, `[gate; up]`: the gate rows, then the up rows, which is what
    Megatron-to-HF converters split in halves. (In the model its rows
    alternate gate, up, gate, up: see megatron_fsdp.transformer.mlp.MLP.)
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype must be one of {list(_SAFETENSORS_DTYPES)}, got {dtype}")
    from .transformer.mlp import MLP

    inner = _unwrap(model)
    state = inner.state_dict()
    interleaved = {f"{name}.linear_fc1.{p}".lstrip(".") for name, m in inner.named_modules()
                   if isinstance(m, MLP) and m.gated for p in ("weight", "bias")}
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
    error, f = None, None
    try:
        if tmp is not None:
            f = open(tmp, "wb")
            f.write(len(header_bytes).to_bytes(8, "little"))
            f.write(header_bytes)
    except OSError as exc:
        error, f = exc, None
    for name, t in state.items():
        # Every rank joins every gather, even after a write failed on rank 0,
        # so that no rank is left waiting in a collective.
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if name in interleaved:
            full = torch.cat([full[0::2], full[1::2]])
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
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if _is_distributed():
        dist.barrier()
