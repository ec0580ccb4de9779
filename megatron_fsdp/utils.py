"""Small helpers shared across the package (Megatron-Core's `megatron.core.utils` place).

The process helpers live here once: whether torch.distributed is up, this
process's rank and the world size, one verdict that every rank agrees on,
objects from rank 0 or from every rank, positive-integer checks, unwrapping
the data-parallel wrapper, and the unsupported-option error.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from . import _torch_compat


# ---------------------------------------------------------------- the process

_TRITON_MODULES: dict = {}  # module name -> the module, or False where Triton is missing


def triton_kernels_for(tensor: torch.Tensor, module: str):
    """The Triton kernels' module `module` (imported on first use) for a CUDA tensor, or None
    (the caller's eager path) for other tensors and where Triton is not installed."""
    if tensor.device.type != "cuda":
        return None
    found = _TRITON_MODULES.get(module)
    if found is None:
        try:
            found = importlib.import_module(module)
        except ImportError:  # a CUDA torch without Triton
            found = False
        _TRITON_MODULES[module] = found
    return found or None


def transpose_first_two(t: torch.Tensor) -> torch.Tensor:
    """t.transpose(0, 1) in a contiguous tensor of its own: what Megatron's
    `transpose(0, 1).contiguous()` gives, except where one of the two dims has size 1 (a
    micro-batch of one sequence), where that is a view of `t`. FSDP2 warns on every rank when a
    wrapped module returns a view (an in-place op on it would skip FSDP's backward hook)."""
    return t.transpose(0, 1).clone(memory_format=torch.contiguous_format)


def is_distributed() -> bool:
    """torch.distributed is available and its default group is up."""
    return dist.is_available() and dist.is_initialized()


def get_rank_safe() -> int:
    """This process's global rank; before the group is up, torchrun's RANK (0 without it)."""
    return dist.get_rank() if is_distributed() else int(os.environ.get("RANK", "0"))


def get_world_size_safe() -> int:
    """The world size; before the group is up, torchrun's WORLD_SIZE (1 without it)."""
    return dist.get_world_size() if is_distributed() else int(os.environ.get("WORLD_SIZE", "1"))


def any_rank(flag: bool, *, device: Optional[torch.device] = None,
             group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank of `group` when `flag` is True on any of them (one
    all-reduce; `device` is where the backend reduces: cuda with NCCL). A
    failure one rank sees must stop every rank alike, not leave the others
    waiting in their next collective."""
    if not is_distributed():
        return bool(flag)
    verdict = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    return bool(verdict.item())


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` (any picklable object) on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value: Any) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not is_distributed():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def gather_to_rank0(value: Any) -> Optional[list]:
    """Every rank's `value` on rank 0 (None elsewhere)."""
    if not is_distributed():
        return [value]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def non_finite_ranks(loss: Optional[torch.Tensor] = None, grads=None, *, device: Optional[torch.device] = None,
                     group: Optional[dist.ProcessGroup] = None, nan_only: bool = False) -> tuple[list[int], list[int]]:
    """(global ranks whose loss is not finite, ranks holding a non-finite
    gradient), the same on every rank of `group`, with one all-reduce for
    both and one read of its result (the step's only wait for the device
    here). `grads` are this rank's local shards (DTensors are read locally).
    `nan_only`: a gradient counts only for a NaN, not for an infinity."""
    grads = [(g.to_local() if hasattr(g, "to_local") else g).detach() for g in (grads or ())]
    if device is None:
        device = loss.device if loss is not None else (grads[0].device if grads else None)
    distributed = is_distributed()
    world = dist.get_world_size(group) if distributed else 1
    rank = dist.get_rank(group) if distributed else 0
    flags = torch.zeros(2, world, device=device)
    if loss is not None:
        flags[0, rank] = (~torch.isfinite(loss.detach())).any().to(device=flags.device, dtype=flags.dtype)
    if grads:
        # The inf-norm is each tensor's max |x|: inf if any element is, NaN if any is.
        norms = torch.stack(_torch_compat.foreach_norm(grads, float("inf")))
        bad = torch.isnan(norms) if nan_only else ~torch.isfinite(norms)
        flags[1, rank] = bad.any().to(device=flags.device, dtype=flags.dtype)
    if distributed:
        dist.all_reduce(flags, group=group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if distributed and group is not None else (lambda r: r)
    bad_loss, bad_grad = ([r for r, bad in enumerate(row) if bad] for row in flags.tolist())
    return [to_global(r) for r in bad_loss], [to_global(r) for r in bad_grad]


# ---------------------------------------------------------------- model hooks

_POST_STEP_HOOKS = "post_optimizer_step_hooks"


def register_post_step_hook(model: torch.nn.Module, name: str, hook) -> None:
    """`hook()` runs after every step of the optimizer that get_megatron_optimizer
    builds for a model holding `model` (state derived from the weights: the
    fp8 converter keeps its scales current this way). One hook per `name` and
    module: registering a name again replaces it."""
    model.__dict__.setdefault(_POST_STEP_HOOKS, {})[name] = hook


def _registered(models, attribute: str):
    """(name, value) of every entry registered under `attribute` on any module of
    `models` (a module or a list), in module order."""
    for model in ([models] if isinstance(models, torch.nn.Module) else models):
        for module in model.modules():
            yield from module.__dict__.get(attribute, {}).items()


def post_step_hooks(models) -> list:
    """The hooks registered on any module of `models` (a module or a list), in module order."""
    return [hook for _, hook in _registered(models, _POST_STEP_HOOKS)]


_WEIGHTS_CHANGED_HOOKS = "weights_changed_hooks"


def register_weights_changed_hook(model: torch.nn.Module, name: str, hook) -> None:
    """`hook()` runs after a data-parallel wrapper holding `model` overwrote its
    weights outside an optimizer step (broadcast_params); loads run torch's
    load_state_dict post-hooks instead. One hook per `name` and module."""
    model.__dict__.setdefault(_WEIGHTS_CHANGED_HOOKS, {})[name] = hook


def weights_changed_hooks(models) -> list:
    """The hooks registered on any module of `models` (a module or a list), in module order."""
    return [hook for _, hook in _registered(models, _WEIGHTS_CHANGED_HOOKS)]


# ---------------------------------------------------------------- checks

def check_hierarchical_sizes(sizes, context_parallel_size: int) -> None:
    """hierarchical_context_parallel_sizes: None, or positive ints whose product is the CP size."""
    if sizes is None:
        return
    if not isinstance(sizes, (list, tuple)) or not sizes or \
            any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"hierarchical_context_parallel_sizes must be a list of positive ints, got {sizes!r}")
    if math.prod(sizes) != context_parallel_size:
        raise ValueError(f"hierarchical_context_parallel_sizes {list(sizes)}: their product ({math.prod(sizes)}) "
                         f"must be context_parallel_size ({context_parallel_size})")


def check_positive_int(name: str, value, where: str = "") -> int:
    """`value` if it is an int >= 1 (a bool is not); else ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where + ': ' if where else ''}{name} must be a positive integer, got {value!r}")
    return value


def reject_unsupported(where: str, options: Mapping[str, tuple], *,
                       error: type[Exception] = NotImplementedError) -> None:
    """The one place that turns "Megatron has this option, we do not" into an error.

    `options` maps a name to `(value, allowed)` or `(value, allowed, why)`:
    a value other than `allowed` raises `error` naming the option, the value,
    what is allowed and why. `allowed=None` means "must be None" and is
    checked by identity, so tensors (forward arguments) can be passed.
    Callers check everything before any work or communication starts.
    """
    for name, spec in options.items():
        value, allowed, *why = spec
        unsupported = value is not None if allowed is None else _differs(value, allowed)
        if unsupported:
            # A tensor or module argument is named by its type (its repr can be huge);
            # a plain value is shown as itself, as the docstring promises.
            shown = repr(value) if allowed is not None or isinstance(value, (bool, int, float, str)) \
                else type(value).__name__
            reason = f": {why[0]}" if why else ""
            raise error(f"{where}: {name}={shown} is not supported by megatron_fsdp "
                        f"(only {allowed!r}){reason}")


def _differs(value: Any, allowed: Any) -> bool:
    try:
        return bool(value != allowed)
    except Exception:  # an object whose != is not a plain bool (a tensor, say)
        return True


def unwrap_model(model, module_instances=None):
    """Megatron-Core's helper: the model(s) inside their wrappers (a list
    stays a list). `module_instances`: the wrapper classes to look through;
    by default the data-parallel wrappers, which say so with the class
    attribute `is_data_parallel_wrapper` (they live above this module)."""
    def is_wrapper(m):
        if module_instances is not None:
            return isinstance(m, module_instances)
        return getattr(type(m), "is_data_parallel_wrapper", False)

    chunks = model if isinstance(model, list) else [model]
    unwrapped = []
    for chunk in chunks:
        while is_wrapper(chunk):
            chunk = chunk.module
        unwrapped.append(chunk)
    return unwrapped if isinstance(model, list) else unwrapped[0]


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """`attr` of `model`, looked up through wrappers (`.module` chains: the
    data-parallel wrapper, Float16Module-style wrappers) as Megatron-Core does.

    With `allow_none=False` an attribute whose value is None does not count
    as found. `return_model_obj=True` returns the (sub)module that holds it.
    """
    if isinstance(model, list):
        raise RuntimeError("get_attr_wrapped_model was given a list of model chunks; pass one chunk")
    found = (lambda m: hasattr(m, attr)) if allow_none else (lambda m: getattr(m, attr, None) is not None)
    holder = model
    while not found(holder):
        if not hasattr(holder, "module"):
            raise RuntimeError(f"get_attr_wrapped_model: {type(model).__name__} and the modules it wraps "
                               f"have no attribute {attr!r}")
        holder = holder.module
    return holder if return_model_obj else getattr(holder, attr)


def get_model_config(model):
    """The TransformerConfig (`.config`) of a model chunk, wrapped or not (Megatron-Core's helper)."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


# ---------------------------------------------------------------- context parallelism

_CP_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")
# parallel_state's get_context_parallel_group, registered by parallel_state (which imports this module).
_context_parallel_group: Optional[Any] = None


def serve_context_parallel_group(getter) -> None:
    """parallel_state hands over its CP group getter: the default of get_batch_on_this_cp_rank."""
    global _context_parallel_group
    _context_parallel_group = getter


def chunks_of_rank(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the 2 x cp_size chunks of a sequence a CP rank keeps (causal load balance)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_for_cp_rank(t: torch.Tensor, seq_dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """`t`'s part on CP rank `cp_rank`: its two chunks along `seq_dim`, concatenated."""
    if cp_size == 1:
        return t
    if t.size(seq_dim) % (2 * cp_size):
        raise ValueError(f"a sequence of {t.size(seq_dim)} tokens cannot be split in 2 x context parallel size "
                         f"({2 * cp_size}) equal chunks")
    shaped = t.view(*t.shape[:seq_dim], 2 * cp_size, t.size(seq_dim) // (2 * cp_size), *t.shape[seq_dim + 1:])
    index = torch.tensor(chunks_of_rank(cp_size, cp_rank), device=t.device)
    kept = shaped.index_select(seq_dim, index)
    return kept.reshape(*t.shape[:seq_dim], -1, *t.shape[seq_dim + 1:])


def get_batch_on_this_cp_rank(batch: dict, is_hybrid_cp: bool = False, cp_group: Optional[dist.ProcessGroup] = None,
                              hybrid_cp_group_func=None, use_per_sequence_balancing: bool = False) -> dict:
    """This context-parallel rank's part of `batch` (Megatron-Core's, at its path): every tensor
    ([b, s, ...]; the attention mask [b, 1, s, s] along its queries) cut into 2 x CP chunks along
    the sequence, of which CP rank r keeps r and 2CP-1-r (causal load balance). `cp_group`:
    parallel_state's CP group by default. Packed sequences (cu_seqlens) and hybrid CP are
    refused in one line."""
    if is_hybrid_cp or hybrid_cp_group_func is not None:
        raise NotImplementedError("get_batch_on_this_cp_rank: hybrid context parallelism is not supported")
    if batch.get("cu_seqlens") is not None:
        raise NotImplementedError("get_batch_on_this_cp_rank: packed sequences (cu_seqlens) are not supported "
                                  "with context parallelism")
    group = cp_group if cp_group is not None else _context_parallel_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return batch
    return {key: value if key in _CP_METADATA_KEYS or value is None else
            split_for_cp_rank(value, 2 if key == "attention_mask" else 1, size, rank)
            for key, value in batch.items()}
