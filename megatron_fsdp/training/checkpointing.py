"""Training checkpoints (Megatron's --ckpt-format torch_dcp): save and load
model, optimizer, LR scheduler, RNG states, iteration and the caller's
training state.

Layout, Megatron's names:

    <save>/latest_checkpointed_iteration.txt     the tracker, written last
    <save>/iter_0000100/                          one checkpoint
        .metadata, __*_*.distcp                   one DCP dict, every rank its part:
            model.*, optimizer.*, main_params.*     the tensors as DTensor shards (the modules' extra
                                                    state too: fp8 histories)
            train_state                             iteration, format, layout, vocabulary, the caller's
                                                    extra state (consumed samples, flags)
            opt_param_scheduler, grad_scaler        the LR scheduler, the fp16 loss scaler
            rng.rank_00003                          each rank's RNG states
            <name>                                  a state registered with the checkpoint manager
        checksums.json                            checksum (crc32c, or zlib crc32 without the extension) and size of every file above

The dict is one of `Stateful` entries (dist_checkpointing.states), each
non-tensor entry one checksummed blob (dist_checkpointing.entries):
save_checkpoint builds it and hands it to the process's checkpoint manager
(dist_checkpointing.manager), which makes one DCP save of it, synchronous
or, with --async-save, in the background. Checkpoints of format 2 (the
same DCP tensors, the entries in common.pt and rng/rank_*.pt) and 3 load
through one migration step (_migrate). A gated fc1 is stored as its full
[gate; up] tensor (format 4); formats 2 and 3 stored its rows interleaved
and load converted (dist_checkpointing.strided).

A checkpoint is written into `iter_XXXXXXX.tmp-<run>-<n>` and published by
rename once every rank finished writing and the checksum manifest is
written (both in DCP's finish step, dist_checkpointing.writer); the tracker
is replaced after that (see dist_checkpointing.publish). A save that dies
part-way leaves the previous checkpoint as the latest.

Loading: rank 0 alone reads the tracker and the manifest and broadcasts what
it found, so every rank loads the same iteration; the DCP metadata is
verified, and it and the non-tensor entries (their own checksums) are
checked first (model flags, learning-rate schedule, optimizer state), then
the ranks split the checksum verification of the files; every check that
can fail runs before any tensor is read, and every rank raises the same
CheckpointError. DCP then reads the
shards the current layout needs (any TP x DP, across vocabulary padding
given the true vocabulary size). RNG states are restored only when the
layout is the one saved.

The fp16 loss scaler (optimizer.grad_scaler) is not part of the torch
optimizer's state dict: it is an entry of its own, and loads with the
optimizer (load_optim). A checkpoint without it keeps the optimizer's
current scale (with a warning, as Megatron does); one with it loading into
an optimizer without a scaler (resumed in bf16 or fp32) skips it.
"""

from __future__ import annotations

import copy
import logging
import os
import types
from typing import Callable, Optional

import torch
from torch import nn

from .. import parallel_state
from ..utils import broadcast_from_rank0, get_rank_safe, get_world_size_safe, unwrap_model
from ..dist_checkpointing import checksums, core, entries, publish, states, torch_dcp
from ..dist_checkpointing.core import CheckpointError
from ..dist_checkpointing.export import export_safetensors
from ..dist_checkpointing.manager import get_checkpoint_manager
from ..dist_checkpointing.vocab_padding import vocab_param_names

__all__ = ["CheckpointError", "TRACKER_FILENAME", "checkpoint_dir", "checkpoint_states", "export_safetensors",
           "load_checkpoint", "load_training_checkpoint", "read_latest_iteration", "save_checkpoint",
           "save_training_checkpoint"]

TRACKER_FILENAME = publish.TRACKER_FILENAME
CKPT_FORMAT = "torch_dcp"
# 4: a gated fc1 (partition_stride 2) stored [gate; up]; up to 3 its rows interleaved gate, up
_FORMAT_VERSION = 4
GATE_UP_SINCE = 4  # the first version storing a gated fc1 as [gate; up]
_METADATA = ".metadata"  # DCP's, written last by its save
_COMMON = "common.pt"  # format 2: the non-tensor entries, rng/ the RNG states
# Verified before anything else is read: what the checkpoint says about itself.
_HEAD_FILES = (_METADATA, _COMMON)
_TRAIN_STATE = "train_state"
_LEGACY_FP8 = "fp8"  # the fp8 scaling histories, before they were module state (Fp8Linear's extra state)

logger = logging.getLogger(__name__)
checkpoint_dir = publish.checkpoint_dir
_is_complete = publish.is_complete


def _layout() -> dict:
    if not parallel_state.model_parallel_is_initialized():
        return {"world_size": 1, "tensor_model_parallel_size": 1, "data_parallel_size": 1}
    return {
        "world_size": get_world_size_safe(),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "num_distributed_optimizer_instances": parallel_state.get_num_distributed_optimizer_instances(),
    }


def _same_ranks(saved: dict, now: dict) -> bool:
    """Each rank's RNG states belong to the same rank of the same layout: world,
    tensor, data and context parallel sizes (not the distributed-optimizer
    instances: a replicated run has one per rank, a sharded one its own count)."""
    keys = ("world_size", "tensor_model_parallel_size", "data_parallel_size", "context_parallel_size")
    return all(saved.get(k, 1 if k == "context_parallel_size" else None) == now.get(k, 1) for k in keys)


_rng_key = states.rng_key


def _rng_name(rank: int) -> str:  # format 2
    return os.path.join("rng", f"{_rng_key(rank)}.pt")


# The DCP dict's top-level names; the train state's own keys (the form load_checkpoint reads).
_OWN_ENTRIES = ("model", "optimizer", "main_params", _TRAIN_STATE, "opt_param_scheduler", "grad_scaler", "rng")
_TRAIN_STATE_KEYS = ("iteration", "format", "version", "layout", "vocab", "extra_state")


def _grad_scaler_state(optimizer) -> Optional[dict]:
    scaler = getattr(optimizer, "grad_scaler", None)
    if scaler is None:
        return None
    # The scale lives on the training device; on the CPU it loads anywhere.
    return {key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            for key, value in scaler.state_dict().items()}


# ---------------------------------------------------------------------- save


def train_state(iteration: int, layout: dict, true_vocab_size: Optional[int], vocab_params: list,
                extra_state: dict) -> dict:
    """The checkpoint's train_state entry (this format and version)."""
    return {"iteration": iteration, "format": CKPT_FORMAT, "version": _FORMAT_VERSION, "layout": layout,
            "vocab": {"true_vocab_size": true_vocab_size, "params": vocab_params}, "extra_state": extra_state}


def checkpoint_states(iteration: int, model: nn.Module, optimizer=None, opt_param_scheduler=None, *,
                      extra_state: Optional[dict] = None, true_vocab_size: Optional[int] = None,
                      extra_states: Optional[dict] = None) -> dict:
    """The one dict of Stateful entries a checkpoint is (see the module's docstring): the
    tensors as shards, every other entry one blob (the same on every rank, which DCP then
    writes once, except each rank's RNG states). `extra_states` ({name: object with
    state_dict() and load_state_dict()}) adds entries of a caller's own."""
    found = torch_dcp.tensor_states(model, optimizer)
    # NOTE: computed when the manager asks (states.Computed): a failure then reaches every rank.
    own = {
        _TRAIN_STATE: states.Computed(lambda: train_state(iteration, _layout(), true_vocab_size,
                                                          vocab_param_names(unwrap_model(model)), extra_state or {})),
        "opt_param_scheduler": opt_param_scheduler,
        "grad_scaler": (states.Computed(lambda: _grad_scaler_state(optimizer))
                        if getattr(optimizer, "grad_scaler", None) is not None else None),
    }
    clash = sorted(set(extra_states or {}) & set(_OWN_ENTRIES + _TRAIN_STATE_KEYS + (_LEGACY_FP8,)))
    if clash:
        raise ValueError(f"checkpoint state {clash} would overwrite the checkpoint's own entries")
    own.update(extra_states or {})
    found.update({name: states.EntryState(value) for name, value in own.items() if value is not None})
    found["rng"] = states.RNGState(_rng_key(get_rank_safe()))
    return found


def save_checkpoint(iteration: int, model: nn.Module, optimizer=None, opt_param_scheduler=None,
                    save_dir: str = None, *, extra_state: Optional[dict] = None,
                    true_vocab_size: Optional[int] = None, record_checksums: bool = True,
                    extra_states: Optional[dict] = None) -> str:
    """Save model, optimizer (its loss scaler included), scheduler, RNG
    states, `iteration` and `extra_state` under `save_dir`; every rank
    writes its own shards and must call this. Returns the checkpoint's path.
    One DCP save through the process's checkpoint manager (with
    --async-save, in the background: published later, see
    dist_checkpointing.manager); no collective of its own.

    `extra_state` holds the caller's training state as plain Python values
    (consumed samples, args as a dict, ...; it is loaded with
    torch.load(weights_only=True)) and comes back as load_checkpoint's
    "extra_state". `true_vocab_size` is the vocabulary before padding: with
    it recorded, a load at another TP size (another padding) works.
    `extra_states` adds entries of the caller's own (objects with
    state_dict() and load_state_dict(); give the same to load_checkpoint).
    `record_checksums=False` writes no checksum manifest (for measurements).
    A failure on any rank raises CheckpointError on every rank, naming the
    rank and the reason; the previous checkpoint stays the latest.
    """
    if not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be a non-negative int, got {iteration!r}")
    if not save_dir:
        raise ValueError("save_dir is required")
    if true_vocab_size is not None and (not isinstance(true_vocab_size, int) or true_vocab_size < 1):
        raise ValueError(f"true_vocab_size must be a positive int, got {true_vocab_size!r}")
    found = checkpoint_states(iteration, model, optimizer, opt_param_scheduler, extra_state=extra_state,
                              true_vocab_size=true_vocab_size, extra_states=extra_states)
    get_checkpoint_manager().save(iteration, found, save_dir, strided_model=unwrap_model(model),
                                  record_checksums=record_checksums)
    return checkpoint_dir(save_dir, iteration)


# ---------------------------------------------------------------------- load


def _on_rank0(func, *args):
    """`func(*args)` on rank 0, its result or CheckpointError on every rank:
    the files it reads can change between two ranks' reads."""
    outcome = None
    if get_rank_safe() == 0:
        try:
            outcome = ("ok", func(*args))
        except (CheckpointError, OSError) as exc:
            outcome = ("error", str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")
    kind, value = broadcast_from_rank0(outcome)
    if kind == "error":
        raise CheckpointError(value)
    return value


def read_latest_iteration(load_dir: str) -> Optional[int]:
    """The iteration the tracker names, or None when `load_dir` has no
    checkpoint. Collective when torch.distributed is initialized: rank 0
    reads the tracker and every rank gets its answer."""
    return _on_rank0(publish.read_tracker, load_dir)


def _find_checkpoint(load_dir: str, iteration: int) -> str:
    """The directory holding `iteration`: its own, or, while a re-save of it
    is between its two renames (or crashed there), the set-aside copy."""
    path = checkpoint_dir(load_dir, iteration)
    if _is_complete(path):
        return path
    aside = [p for p in publish.set_aside_copies(path) if _is_complete(p)]
    return aside[-1] if aside else path


def _resolve(load_dir: str, iteration: Optional[int], verify: bool) -> dict:
    """Rank 0's view: the checkpoint to load and its manifest, or why there is none."""
    if iteration is None:
        if not os.path.exists(load_dir):
            return {"missing": f"{load_dir} does not exist"}
        if not os.path.isdir(load_dir):
            return {"missing": f"{load_dir} is a file, not a checkpoint directory"}
        iteration = publish.read_tracker(load_dir)
        if iteration is None:
            return {"missing": f"no checkpoint in {load_dir}: {TRACKER_FILENAME} not found"}
    path = _find_checkpoint(load_dir, iteration)
    if not _is_complete(path):
        raise CheckpointError(f"checkpoint {path} is missing or incomplete (no {_METADATA})")
    manifest = checksums.read_manifest(path) if verify else None
    logger.info("loading checkpoint %s (iteration %d, as rank 0 read %s)", path, iteration, load_dir)
    return {"missing": None, "path": path, "manifest": manifest}


def _read_entries(path: str, saved: dict, extra_names) -> dict:
    """The non-tensor entries, in one dict: the train state's keys, "opt_param_scheduler",
    "grad_scaler" and the `extra_names` (None where the checkpoint has none)."""
    if os.path.isfile(os.path.join(path, _COMMON)):  # format 2: common.pt held them all
        try:
            return torch.load(os.path.join(path, _COMMON), weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path}: {_COMMON} is corrupt ({exc})") from exc
    if _TRAIN_STATE not in saved:
        if os.path.isfile(os.path.join(path, "metadata.json")):
            raise CheckpointError(f"checkpoint {path} is a Megatron-Core distributed checkpoint: convert it with "
                                  "tools/checkpoint/convert.py --loader mcore --saver megatron_fsdp, then load "
                                  "that with --finetune")
        raise CheckpointError(f"checkpoint {path} has neither a {_TRAIN_STATE} entry nor {_COMMON}: not a "
                              "checkpoint of this format")
    names = [n for n in (_TRAIN_STATE, "opt_param_scheduler", "grad_scaler", _LEGACY_FP8, *extra_names) if n in saved]
    blobs = torch_dcp.read_entries(path, names)
    found = {name: entries.unpack(blob, f"checkpoint {path}: its {name} entry") for name, blob in blobs.items()}
    train_state = found.pop(_TRAIN_STATE)
    return {"opt_param_scheduler": None, "grad_scaler": None, **found, **train_state}


def _read_common(path: str, optimizer, opt_param_scheduler, load_optim: bool, extra_names) -> tuple[dict, dict]:
    """The non-tensor entries and the DCP metadata, checked against what is to be loaded."""
    saved = torch_dcp.read_metadata(path)
    common = _read_entries(path, saved, extra_names)
    if common.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {common.get('format')!r}, expected {CKPT_FORMAT!r}")
    if common.get("version", 2) > _FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {common['version']}, written by a newer "
                              f"megatron_fsdp; this one reads versions up to {_FORMAT_VERSION}")
    if load_optim and optimizer is not None and not any(k.startswith("optimizer.") for k in saved):
        raise CheckpointError(f"checkpoint {path} holds no optimizer state (it was saved without an "
                              "optimizer): load it with load_optim=False (--no-load-optim)")
    if load_optim and opt_param_scheduler is not None and common.get("opt_param_scheduler") is None:
        raise CheckpointError(f"checkpoint {path} holds no learning-rate scheduler state: load it with "
                              "load_optim=False (--no-load-optim), or without a scheduler")
    return common, saved


def _read_rng_state(path: str, saved: dict, key: str, format_2_path: str) -> dict:
    if key in saved:
        return entries.unpack(torch_dcp.read_entries(path, [key])[key], f"checkpoint {path}: its {key} entry")
    if not os.path.isfile(format_2_path):
        raise CheckpointError(f"checkpoint {path} has no RNG state for rank {get_rank_safe()}: load it with "
                              "load_rng=False (--no-load-rng)")
    try:
        return torch.load(format_2_path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: {format_2_path} is corrupt ({exc})") from exc


def _grad_scaler_to_load(path: str, common: dict, optimizer, load_optim: bool) -> Optional[dict]:
    """The loss-scaler state to load into optimizer.grad_scaler, or None;
    raises CheckpointError when it does not fit the scaler."""
    if not load_optim or optimizer is None:
        return None
    scaler, saved = getattr(optimizer, "grad_scaler", None), common.get("grad_scaler")
    log = logger if get_rank_safe() == 0 else None  # every rank decides alike: one says so
    if scaler is None:
        if saved and log:
            log.info("checkpoint %s holds fp16 loss-scaler state; the optimizer has no loss scaler "
                     "(bf16/fp32 resume): not loading it", path)
        return None
    if not scaler.state_dict():
        if saved and log:
            log.info("checkpoint %s holds dynamic loss-scaler state; the optimizer's loss scale is constant "
                     "(%s): not loading it", path, float(scaler.scale))
        return None
    if not saved:
        if log:
            log.warning("checkpoint %s holds no dynamic loss-scaler state (saved without fp16 dynamic loss "
                        "scaling, or by an older version): keeping the current loss scale %s",
                        path, float(scaler.scale))
        return None
    try:
        # On a copy: nothing is changed before every check has passed on every rank.
        copy.deepcopy(scaler).load_state_dict(saved)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: its loss-scaler state does not fit the optimizer's "
                              f"{type(scaler).__name__} ({type(exc).__name__}: {exc})") from exc
    return saved


def _check_scheduler(opt_param_scheduler, saved: dict) -> None:
    """The scheduler's own load-time check (a changed schedule needs
    override_opt_param_scheduler or use_checkpoint_opt_param_scheduler), run on
    a copy that steers no optimizer, so that it can refuse before any shard is read."""
    probe = copy.copy(opt_param_scheduler)
    probe.optimizer = types.SimpleNamespace(param_groups=[])
    try:
        probe.load_state_dict(saved)
    except (ValueError, KeyError) as exc:
        # (raise_if_any_failed names the checkpoint)
        raise CheckpointError(f"the learning-rate schedule differs from the checkpoint's: {exc}") from exc


def _padded_vocab_sizes(model: nn.Module, saved: dict, state: dict) -> Optional[tuple[int, int]]:
    """(rows saved, rows now) of the vocabulary tables when the padding differs, else None."""
    for name in vocab_param_names(unwrap_model(model)):
        before, now = saved.get(f"model.{name}"), state.get("model", {}).get(name)
        if before is None or now is None or not hasattr(before, "size"):
            continue
        if int(before.size[0]) != int(now.shape[0]):
            return int(before.size[0]), int(now.shape[0])
    return None


def load_checkpoint(model: nn.Module, optimizer=None, opt_param_scheduler=None, load_dir: str = None, *,
                    iteration: Optional[int] = None, load_optim: bool = True, load_rng: bool = True,
                    true_vocab_size: Optional[int] = None, verify: bool = True,
                    exit_on_missing_checkpoint: bool = False,
                    check_extra_state: Optional[Callable[[dict], None]] = None,
                    extra_states: Optional[dict] = None) -> dict:
    """Load the latest checkpoint (or `iteration`) from `load_dir` into the
    model, optimizer and scheduler, resharding to the current layout. Every
    rank must call this.

    As in Megatron, `load_optim=False` (--no-load-optim) loads neither the
    optimizer (its loss scaler included) nor the scheduler, and refreshes
    fp32 main params from the loaded model. `true_vocab_size` (the
    vocabulary before padding) lets the embedding and output rows, and
    their optimizer state, load across a different padding (another TP
    size); the padding rows are zero-filled. Without it on both sides the
    shapes must match exactly. `verify=False`
    (--no-verify-checkpoint) skips the checksum verification.
    `check_extra_state(extra_state)` may raise CheckpointError to refuse
    the checkpoint before any shard is read (the training flags, say).

    `extra_states` ({name: object with load_state_dict()}) gets the entries
    save_checkpoint's `extra_states` wrote (None from a checkpoint without
    one), after the model is loaded.

    The scheduler's schedule is checked against the checkpoint's before any
    shard is read too (a change needs the scheduler's
    override_opt_param_scheduler or use_checkpoint_opt_param_scheduler).

    Returns {"iteration", "extra_state", "rng_restored", "path", "missing",
    "padded_vocab_size"}; the last is (rows saved, rows now) of the
    vocabulary tables when the two paddings differ (another TP size), else None.
    When `load_dir` is missing, empty, or a file, that is iteration 0 with
    "missing" saying why (the caller warns and starts from scratch), or with
    `exit_on_missing_checkpoint` (--exit-on-missing-checkpoint) a
    CheckpointError. Every other failure raises CheckpointError on every
    rank, before any shard is read where it can be known then.
    """
    if not load_dir:
        raise ValueError("load_dir is required")
    found = _on_rank0(_resolve, load_dir, iteration, verify)
    if found["missing"]:
        return _nothing_to_load(found["missing"], exit_on_missing_checkpoint)
    path, manifest = found["path"], (found["manifest"] or {}) if verify else None
    # What the checkpoint says about itself (the DCP metadata and the non-tensor entries, a few
    # kilobytes) is verified and checked first: a refusal costs no read of a tensor.
    _verify(path, manifest, head=True)
    common, saved = _agreed(path, _read_and_check, path, optimizer, opt_param_scheduler, load_optim,
                            check_extra_state, extra_states)
    _verify(path, manifest, head=False)
    plan = _agreed(path, _plan_load, path, model, optimizer, common, saved, load_optim, load_rng, true_vocab_size)
    _migrate(path, model, optimizer, common, plan)
    _apply_entries(common, plan, optimizer, opt_param_scheduler, load_optim, extra_states)
    return {"iteration": common["iteration"], "extra_state": common["extra_state"],
            "rng_restored": plan["rng"] is not None, "path": path, "missing": None,
            "padded_vocab_size": plan["padded"]}


def _nothing_to_load(missing: str, exit_on_missing_checkpoint: bool) -> dict:
    if exit_on_missing_checkpoint:
        raise CheckpointError(f"{missing}; --exit-on-missing-checkpoint stops here instead of training from scratch")
    return {"iteration": 0, "extra_state": {}, "rng_restored": False, "path": None, "missing": missing,
            "padded_vocab_size": None}


def _verify(path: str, manifest: Optional[dict], head: bool) -> None:
    """Checksums of the head files (the metadata, common.pt) or of the rest; the ranks split the files."""
    if manifest is not None:
        checksums.verify(path, {name: entry for name, entry in manifest.items() if (name in _HEAD_FILES) == head})


def _agreed(path: str, step, *args):
    """`step(*args)` on every rank, and one verdict: a CheckpointError on any rank raises on all."""
    error, result = None, None
    try:
        result = step(*args)
    except CheckpointError as exc:
        error = exc
    core.raise_if_any_failed(error, f"loading checkpoint {path} failed")
    return result


def _read_and_check(path: str, optimizer, opt_param_scheduler, load_optim: bool, check_extra_state,
                    extra_states: Optional[dict]) -> tuple[dict, dict]:
    common, saved = _read_common(path, optimizer, opt_param_scheduler, load_optim, extra_states or {})
    if check_extra_state is not None:
        check_extra_state(common["extra_state"])
    if load_optim and opt_param_scheduler is not None:
        _check_scheduler(opt_param_scheduler, common["opt_param_scheduler"])
    return common, saved


def _plan_load(path: str, model: nn.Module, optimizer, common: dict, saved: dict, load_optim: bool, load_rng: bool,
               true_vocab_size: Optional[int]) -> dict:
    """What the load reads and applies, every check that can fail done: the loss-scaler state,
    the tensor entries and their targets, the vocabulary rows, this rank's RNG states."""
    plan = {"scaler": _grad_scaler_to_load(path, common, optimizer, load_optim), "rng": None}
    plan["states"], plan["targets"], plan["rows"] = torch_dcp.prepare_load(
        path, model, optimizer if load_optim else None, saved, common.get("vocab", {}).get("true_vocab_size"),
        true_vocab_size)
    plan["padded"] = _padded_vocab_sizes(model, saved, plan["targets"])
    if load_rng and _same_ranks(common["layout"], _layout()):
        # read now (no tensor): a missing or damaged one stops every rank before the load
        rank = get_rank_safe()
        plan["rng"] = _read_rng_state(path, saved, f"rng.{_rng_key(rank)}", os.path.join(path, _rng_name(rank)))
    return plan


def _migrate(path: str, model: nn.Module, optimizer, common: dict, plan: dict) -> None:
    """The tensors read and applied (collective), older formats converted on the way: a format-3
    gated fc1's interleaved rows, fp8 histories kept beside the model before they were its state."""
    version = common.get("version", 2)
    converted = torch_dcp.load_sharded(path, model, optimizer, plan["states"], plan["targets"], plan["rows"],
                                       legacy_interleaved=version < GATE_UP_SINCE)
    if converted and get_rank_safe() == 0:
        logger.info("checkpoint %s (format version %s) stores gated MLPs' fc1 with gate and up rows interleaved: "
                    "converted %d tensors to the [gate; up] layout on load; the next save writes format %d",
                    path, version, converted, _FORMAT_VERSION)
    if common.get(_LEGACY_FP8):
        from ..fp8 import load_fp8_state_dict  # only for such a checkpoint: a run without fp8 loads no fp8 stack

        load_fp8_state_dict(unwrap_model(model), common[_LEGACY_FP8])  # every rank (it communicates)


def _apply_entries(common: dict, plan: dict, optimizer, opt_param_scheduler, load_optim: bool,
                   extra_states: Optional[dict]) -> None:
    for name, state in (extra_states or {}).items():
        state.load_state_dict(common.get(name))  # every rank (it may communicate)
    if load_optim and opt_param_scheduler is not None:
        opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])
    if plan["scaler"] is not None:
        optimizer.grad_scaler.load_state_dict(plan["scaler"])
    if plan["rng"] is not None:
        states.set_rng_state(plan["rng"])


# ---------------------------------------------------------------------- training state

# Flags that fix the model's architecture: a checkpoint resumes only into the same ones.
ARCHITECTURE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                      "kv_channels", "swiglu", "normalization", "position_embedding_type",
                      "untie_embeddings_and_output_weights", "disable_bias_linear", "max_position_embeddings",
                      "group_query_attention", "add_qkv_bias", "norm_epsilon", "rotary_base", "rotary_percent",
                      "use_rope_scaling", "rope_scaling_factor", "qk_layernorm", "num_experts", "moe_ffn_hidden_size",
                      "moe_layer_freq", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                      "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                      "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
# Flags a checkpoint also stores, which --use-checkpoint-args fills in only where the command line
# leaves them out (as Megatron-LM's load_args_from_checkpoint does): not the architecture's. The
# load-balancing loss's coefficient travels with a converted MoE model (router_aux_loss_coef).
RUN_DEFAULT_ARGS = ("seq_length", "moe_aux_loss_coeff")


def save_training_checkpoint(args, iteration: int, model, optimizer, opt_param_scheduler,
                             num_floating_point_operations_so_far: float = 0.0,
                             true_vocab_size: Optional[int] = None) -> str:
    """save_checkpoint to args.save with the training loop's state: consumed
    train/validation samples (so a resume reads the next sample an
    uninterrupted run would), the FLOPs so far, the architecture flags and,
    (through save_checkpoint) what the model registered to travel with it."""
    extra = {
        "consumed_train_samples": int(args.consumed_train_samples),
        "consumed_valid_samples": int(args.consumed_valid_samples),
        "num_floating_point_operations_so_far": float(num_floating_point_operations_so_far),
        "args": {name: getattr(args, name, None) for name in ARCHITECTURE_ARGS + RUN_DEFAULT_ARGS},
    }
    model = model[0] if isinstance(model, list) else model
    return save_checkpoint(iteration, model, optimizer, opt_param_scheduler, args.save, extra_state=extra,
                           true_vocab_size=true_vocab_size)


def load_training_checkpoint(args, model, optimizer, opt_param_scheduler,
                             true_vocab_size: Optional[int] = None) -> tuple[int, float, dict]:
    """Megatron-LM's --load/--finetune/--no-load-optim/--no-load-rng: load
    args.load and restore args.consumed_train_samples and
    args.consumed_valid_samples. Returns (iteration, FLOPs so far, what
    load_checkpoint returned); (0, 0.0, ...) for a fresh start."""
    model = model[0] if isinstance(model, list) else model

    def same_architecture(extra: dict) -> None:
        saved_args = extra.get("args") or {}
        differing = {name: (saved_args[name], getattr(args, name, None)) for name in ARCHITECTURE_ARGS
                     if name in saved_args and saved_args[name] != getattr(args, name, None)}
        if differing:
            raise CheckpointError(f"checkpoint in {args.load} was saved with other model flags: "
                                  + ", ".join(f"--{k.replace('_', '-')} {v[0]!r} (now {v[1]!r})"
                                              for k, v in differing.items()))

    loaded = load_checkpoint(model, optimizer, opt_param_scheduler, args.load,
                             load_optim=not (args.no_load_optim or args.finetune),
                             load_rng=not (args.no_load_rng or args.finetune),
                             true_vocab_size=true_vocab_size, verify=not args.no_verify_checkpoint,
                             exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
                             check_extra_state=same_architecture)
    if loaded.get("missing"):
        return 0, 0.0, loaded
    extra = loaded["extra_state"]
    if args.finetune:
        return 0, 0.0, loaded
    args.consumed_train_samples = int(extra.get("consumed_train_samples", 0))
    args.consumed_valid_samples = int(extra.get("consumed_valid_samples", 0))
    return loaded["iteration"], float(extra.get("num_floating_point_operations_so_far", 0.0)), loaded
