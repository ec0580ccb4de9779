"""Parameter construction shared by the tensor-parallel layers."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import parallel_state
from .partition_stride import rank_rows


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of a parameter: a TP DTensor's shard, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _building_on_meta() -> bool:
    return torch.empty(0).device.type == "meta"


def init_full_tensor(shape: tuple[int, ...], init_method: Optional[Callable], config) -> torch.Tensor:
    """The full (unsharded) initial value, identical on every rank and for every TP size.

    Every rank draws the whole tensor from the same generator state and later
    keeps its shard, so a TP=1 and a TP=4 model built from the same seed hold
    the same weights. Under a meta-device context nothing is drawn. With
    config.perform_initialization=False only `constant_init` methods (biases,
    norm weights) are applied, as in Megatron.
    """
    if _building_on_meta():
        return torch.empty(shape, device="meta", dtype=torch.float32)
    device = parallel_state.get_device()
    init_device = torch.device("cpu") if config.use_cpu_initialization else device
    full = torch.empty(shape, dtype=torch.float32, device=init_device)
    # Megatron sets biases and norm weights whatever perform_initialization
    # says; only weights drawn at random are left uninitialized when it is False.
    if getattr(init_method, "ignores_perform_initialization", False) or (
            config.perform_initialization and init_method is not None):
        with torch.no_grad():
            init_method(full)
    return full


def constant_init(value: float) -> Callable:
    """Fills with `value`; applied even with perform_initialization=False, as
    Megatron zeroes biases and sets norm weights in that case too."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.constant_(tensor, value)

    init_.ignores_perform_initialization = True
    init_.constant = value  # (megatron_fsdp.initialization fills a shard in place)
    return init_


def record_init(module: torch.nn.Module, name: str, init_method: Optional[Callable], config) -> None:
    """Declare how `module.<name>` starts (`init_method` and the config's
    perform_initialization): the module's reset_parameters() and
    megatron_fsdp.initialization (a meta-device model) initialize it from this."""
    if "_megatron_param_init" not in module.__dict__:
        module._megatron_param_init = {}
    module._megatron_param_init[name] = (init_method, config)


def recorded_inits(module: torch.nn.Module) -> dict:
    """name -> (init_method, config) that `module` declared for its own parameters (record_init)."""
    return module.__dict__.get("_megatron_param_init", {})


# Megatron's per-parameter record of how tensor parallelism splits it (the
# expert and fused-QKV entries are Megatron's too; our layers leave them unset).
_TP_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1,
                          "expert_tp": False, "is_qkv": False, "qkv_split_shapes": None}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    for attribute in _TP_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise ValueError(f"{attribute} is already set on this tensor ({getattr(tensor, attribute)!r})")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for attribute, default in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, default)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    for attribute in _TP_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None,
                                           expert_tp_group: Optional[dist.ProcessGroup] = None) -> bool:
    """True where this rank's copy of `param` counts once across TP: a TP-split
    parameter on every rank, a replicated one on rank 0 of `tp_group` (default:
    parallel_state's TP group; `expert_tp_group` for a parameter marked
    `allreduce=False`, as Megatron marks expert parameters)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    if not getattr(param, "allreduce", True) and expert_tp_group is not None:
        tp_group = expert_tp_group
    if tp_group is not None:
        return dist.get_rank(tp_group) == 0
    return parallel_state.get_tensor_model_parallel_rank() == 0


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    last = tensor.dim() - 1
    chunks = torch.split(tensor, divide(tensor.size(last), num_partitions), dim=last)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks


def _tp_group_or_default(tp_group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    return parallel_state.get_tensor_model_parallel_group() if tp_group is None else tp_group


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, new_buffer: bool = False,
                                      tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This TP rank's 1/TP of `tensor`'s elements (flattened): a view, or a
    new tensor with `new_buffer`."""
    group = _tp_group_or_default(tp_group)
    size = dist.get_world_size(group)
    # Megatron floors the chunk size and drops the remainder; that loses data silently.
    if tensor.numel() % size != 0:
        raise ValueError(f"split_tensor_into_1d_equal_chunks: {tensor.numel()} elements are not divisible "
                         f"by the tensor-parallel size {size}")
    chunk = tensor.numel() // size
    start = chunk * dist.get_rank(group)
    data = tensor.view(-1)[start:start + chunk]
    return data.clone() if new_buffer else data


def gather_split_1d_tensor(tensor: torch.Tensor, tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The inverse of split_tensor_into_1d_equal_chunks: every TP rank's chunk,
    concatenated in rank order, as a new 1D tensor."""
    group = _tp_group_or_default(tp_group)
    gathered = torch.empty(tensor.numel() * dist.get_world_size(group), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(gathered, tensor.contiguous().view(-1), group=group)
    return gathered


class VocabUtility:
    """The [first, last) vocabulary indices of one TP rank's partition."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            divide(global_vocab_size, world_size), rank, world_size)


def make_tp_parameter(full: torch.Tensor, shard_dim: Optional[int], config, stride: int = 1) -> torch.nn.Parameter:
    """A parameter holding this rank's part of `full` as a DTensor on the TP mesh:
    Shard(shard_dim), or Replicate() when `shard_dim` is None. With `stride` > 1
    (shard_dim 0 only), the rank's part is Megatron's partition_stride split
    (tensor_parallel.partition_stride): the DTensor is Shard(0) of the ranks' parts.

    With a tensor-parallel size of 1 the parameter is a plain tensor: there is
    nothing to shard, and FSDP2 offers features to plain parameters that it
    does not to DTensor ones (an int reshard_after_forward, for one).
    Checkpoints still reshard: DCP loads a plain tensor into a DTensor and back.
    """
    mesh = parallel_state.get_tensor_model_parallel_mesh()
    tp_size = mesh.size()
    if shard_dim is None:
        local, placement = full, Replicate()
    else:
        if full.size(shard_dim) % tp_size != 0:
            raise ValueError(
                f"dimension {shard_dim} of size {full.size(shard_dim)} is not divisible by "
                f"the tensor-parallel size {tp_size}"
            )
        if stride != 1 and shard_dim != 0:
            raise ValueError(f"a partition_stride of {stride} splits dimension 0 only, not {shard_dim}")
        local = rank_rows(full, stride, tp_size, mesh.get_local_rank()) if stride != 1 else \
            full.chunk(tp_size, dim=shard_dim)[mesh.get_local_rank()]
        placement = Shard(shard_dim)
    device = full.device if full.device.type == "meta" else parallel_state.get_device()
    # copy=True: a shard that is a view would keep the whole `full` tensor alive.
    local = local.to(device=device, dtype=config.params_dtype, copy=True,
                     memory_format=torch.contiguous_format)
    if tp_size == 1:
        param = torch.nn.Parameter(local)
    else:
        param = torch.nn.Parameter(DTensor.from_local(local, mesh, [placement], run_check=False,
                                                      shape=full.shape, stride=full.stride()))
    # Megatron marks a split weight as TP-parallel at every TP size (TP=1 included).
    set_tensor_model_parallel_attributes(param, shard_dim is not None, -1 if shard_dim is None else shard_dim, stride)
    return param
