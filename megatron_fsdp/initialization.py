"""Initialize a model that was built on the meta device, each rank drawing
only the part of each parameter it holds.

Every megatron_fsdp layer declares how each of its parameters starts
(tensor_parallel.utils.record_init: N(0, std), a constant, or any callable)
and has a `reset_parameters()` of its own. `initialize_parameters(model)`
resets every declared parameter of the model once the parameters are
materialized (and sharded, however: TP, FSDP or both):

- N(0, std) values come from a counter-based generator: the value of element
  i of a parameter is a function of (seed, the parameter's name, i), so each
  rank computes its own shard's values directly, the full tensor never
  exists anywhere, and the full weights are the same at every TP and
  data-parallel size (bit for bit; tests/test_fsdp.py). These values are not
  the ones an eager build draws from torch's generator: meta-built and
  eagerly built models start from different (equally distributed) weights.
- constants (biases, norm weights) are filled in place;
- any other callable (an init_method of the user's) is applied, as before, to
  the full tensor drawn on every rank from torch's generator, of which each
  rank keeps its part.

The seed is one draw from torch's default generator when initialize_parameters
starts, rank 0's for every rank: seeded as before a normal build, the run is
reproducible, and a second model initialized afterwards differs from the first.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from . import _torch_compat, parallel_state
from .tensor_parallel import partition_stride
from .tensor_parallel.utils import init_full_tensor, recorded_inits
from .utils import broadcast_from_rank0

# splitmix64 (Steele, Lea, Flood), in int64 arithmetic that wraps.
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_BLOCK = 1 << 22  # elements generated at a time: bounds the temporaries


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)  # logical, not arithmetic


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _uniform(stream: int, counter: torch.Tensor) -> torch.Tensor:
    """float64 in [0, 1): the top 53 bits of splitmix64 at `counter` of `stream`."""
    return _shift_right(_mix(counter * _GOLDEN + stream), 11).double() * (2.0 ** -53)


def counter_normal(stream: int, index: torch.Tensor) -> torch.Tensor:
    """Standard normal float64 values for the int64 element indices `index` of
    `stream` (Box-Muller on two uniforms per element): a pure function of both."""
    u1 = 1.0 - _uniform(stream, 2 * index + 1)  # (0, 1]: log is finite
    u2 = _uniform(stream, 2 * index + 2)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)


def _stream(seed: int, name: str) -> int:
    key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)
    return int(_mix(torch.tensor(seed ^ key, dtype=torch.int64)))


def normal_std(init_method: Optional[Callable]) -> Optional[float]:
    """The std of an N(0, std) init method (ours, or Megatron-Core's partial of
    torch.nn.init.normal_), else None."""
    std = getattr(init_method, "normal_std", None)
    if std is not None:
        return float(std)
    if (isinstance(init_method, functools.partial) and init_method.func is torch.nn.init.normal_
            and not init_method.args and init_method.keywords.get("mean", 0.0) == 0.0):
        return float(init_method.keywords.get("std", 1.0))
    return None


def _local_chunk(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's data of `param` and where it starts in the full tensor."""
    local = _torch_compat.local_tensor(param)
    (chunk,) = _torch_compat.create_chunk_list(param)
    return local, tuple(int(o) for o in chunk.offsets)


@torch.no_grad()
def fill_normal_slice(param: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Write N(0, std) into this rank's part of `param`: element i of the full
    tensor (row-major) gets counter_normal(stream of `name`, i) * std."""
    local, offsets = _local_chunk(param)
    if local.numel() == 0:
        return
    stream = _stream(seed, name)
    shape, full = tuple(local.shape), tuple(param.shape)
    stride, tp = partition_stride.stride_of(param), parallel_state.get_tensor_model_parallel_world_size()
    strides = [math.prod(full[d + 1:]) for d in range(len(full))]
    device = local.device
    # The index of each element of one local row: sum over dims 1.. of (offset + position) * stride.
    inner = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(1, len(shape)):
        inner = inner.unsqueeze(-1) + (torch.arange(shape[d], device=device) + offsets[d]) * strides[d]
    inner = inner.reshape(1, -1)
    # Straight into a plain contiguous shard; through a buffer of its size into anything else
    # (an fp8 training weight, a strided view).
    direct = type(local) in (torch.Tensor, nn.Parameter) and local.is_contiguous()
    target = local if direct else torch.empty(shape, dtype=local.dtype, device=device)
    rows_view = target.view(shape[0], inner.shape[1])
    rows_per_block = max(1, _BLOCK // inner.shape[1])
    for start in range(0, shape[0], rows_per_block):
        stop = min(start + rows_per_block, shape[0])
        rows = torch.arange(start, stop, device=device) + offsets[0]
        if stride != 1:  # the DTensor's rows are the ranks' strided parts: index the full tensor's
            rows = partition_stride.full_rows(rows, full[0], stride, tp)
        rows = rows * strides[0]
        rows_view[start:stop].copy_(counter_normal(stream, rows.unsqueeze(1) + inner) * std)
    if not direct:
        local.copy_(target)


@torch.no_grad()
def _write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Each rank keeps its part of the full tensor `full`."""
    stride = partition_stride.stride_of(param)
    if stride != 1:  # NOTE: only a strided parameter's rows are the TP ranks' blocks
        full = partition_stride.to_blocks(full, stride, parallel_state.get_tensor_model_parallel_world_size())
    if isinstance(param, DTensor):
        full = full.to(param.device_mesh.device_type)
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def reset_parameter(param: torch.Tensor, init_method: Optional[Callable], config, seed: Optional[int] = None,
                    name: str = "") -> None:
    """Initialize one parameter, however it is sharded (see the module's
    docstring). `seed` None: as an eager build does (the full tensor from
    torch's generator, each rank keeping its part); with a seed, N(0, std)
    methods draw only this rank's part, keyed by `name`."""
    constant = getattr(init_method, "constant", None)
    if constant is not None:  # applied whatever perform_initialization says, as Megatron does
        _torch_compat.local_tensor(param).fill_(constant)
        return
    if init_method is None or not config.perform_initialization:
        return  # left as it is, as Megatron leaves weights with perform_initialization=False
    std = normal_std(init_method) if seed is not None else None
    if std is not None:
        fill_normal_slice(param, std, seed, name)
    else:
        _write_full(param, init_full_tensor(tuple(param.shape), init_method, config))


def reset_recorded_parameters(module: nn.Module) -> None:
    """A layer's reset_parameters(): its declared parameters (record_init) start
    again as a build draws them (full tensors from torch's generator, each rank
    keeping its part)."""
    for name, (init_method, config) in recorded_inits(module).items():
        reset_parameter(getattr(module, name), init_method, config)


def _unrecorded_parameters(model: nn.Module) -> list[str]:
    recorded = {id(getattr(m, name)) for m in model.modules() for name in recorded_inits(m)}
    return [name for name, p in model.named_parameters() if id(p) not in recorded]


def unrecorded_parameters_of_layers(model: nn.Module) -> list[str]:
    """The parameters that megatron_fsdp layers (modules with recorded parameters) hold without a
    record (a subclass's own): neither initialize_parameters nor the layer's reset knows them."""
    recorded = {id(getattr(m, name)) for m in model.modules() for name in recorded_inits(m)}
    return [f"{prefix}.{name}" if prefix else name for prefix, m in model.named_modules() if recorded_inits(m)
            for name, p in m.named_parameters(recurse=False) if id(p) not in recorded]


def has_recorded_parameters(module: nn.Module) -> bool:
    """Whether `module` itself declares how some of its parameters start (a megatron_fsdp layer)."""
    return bool(recorded_inits(module))


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: Optional[int] = None, *, others_initialized: bool = False) -> None:
    """Initialize every parameter of a materialized meta-device model, each rank
    drawing only its part (see the module's docstring). `seed` defaults to one
    draw from torch's default generator, rank 0's for every rank (a collective
    when torch.distributed is initialized: call it on every rank, or pass a seed).
    Raises if the model holds a parameter whose initialization is unknown, unless
    `others_initialized`: the caller has initialized those (their modules' own
    reset_parameters(), as NVIDIA's fully_shard does for any model)."""
    missing = [] if others_initialized else _unrecorded_parameters(model)
    if missing:
        raise ValueError(
            f"cannot initialize parameters not created by megatron_fsdp layers: {missing[:5]}"
            + (" ..." if len(missing) > 5 else "")
        )
    if seed is None:
        seed = int(torch.empty((), dtype=torch.int64).random_())
        # Every rank must draw from the same stream (replicas of a parameter hold the same
        # values): rank 0's draw wins.
        seed = broadcast_from_rank0(seed)
    names = {}
    for name, param in model.named_parameters():  # a shared (tied) parameter: its first name
        names.setdefault(id(param), name)
    done = set()
    for module in model.modules():
        for pname, (init_method, config) in recorded_inits(module).items():
            param = getattr(module, pname)
            if param.device.type == "meta":
                raise ValueError(f"parameter {pname} of {type(module).__name__} is still on the meta "
                                 "device: call model.to_empty(device=...) first")
            if id(param) in done:
                continue
            done.add(id(param))
            reset_parameter(param, init_method, config, seed, names[id(param)])
        reset_buffers = getattr(module, "reset_buffers", None)
        if callable(reset_buffers):
            reset_buffers()
