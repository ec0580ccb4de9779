"""Model-parallel process groups, built on one DeviceMesh.

Megatron-Core keeps dozens of module-level globals for its groups. Here one
frozen `_ParallelState` holds the root DeviceMesh and everything derived from
it; the Megatron getters read from it. Code that wants DTensor asks for the
mesh itself (`get_device_mesh()`, `get_tensor_model_parallel_mesh()`, ...).

Mesh dimensions, slowest-varying first, follow the reversed `order` string
(Megatron's rank layout: the first name in `order` varies fastest). The
data-parallel dimension is split into ``dp_replicate`` (one entry per
distributed-optimizer instance) and ``dp_shard`` so HSDP can use it as 2D.
Flattened views: ``dp`` (= dp_replicate x dp_shard), ``dp_cp``, and
``dp_shard_cp`` (the ranks of one distributed-optimizer instance).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_SUPPORTED_ORDER_DIMS = ("tp", "cp", "ep", "dp", "pp")


@dataclasses.dataclass(frozen=True)
class _ParallelState:
    mesh: DeviceMesh
    # 1D meshes by name: the root's dims and the flattened views. Flattened
    # views are kept here because slicing them from the root is deprecated.
    dim_meshes: dict[str, DeviceMesh]
    device_type: str
    tensor_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    num_distributed_optimizer_instances: int
    order: str
    # gloo groups over the same ranks as "dp" and "dp_cp" (Megatron's
    # *_gloo groups, for CPU-side work); None unless asked for.
    gloo_groups: Optional[dict[str, dist.ProcessGroup]] = None


_STATE: Optional[_ParallelState] = None

# DeviceMeshes built so far, by (device type, shape, names).
# DTensor caches sharding decisions keyed by mesh *equality*, so a DTensor op
# after a re-initialization can be handed an earlier, equal mesh: its process
# groups must still be alive. Re-initializing with a layout seen before
# therefore reuses its mesh, and groups are never destroyed while the default
# process group lives (torch frees them with it).
_MESH_CACHE: dict[tuple, tuple[DeviceMesh, dict[str, DeviceMesh]]] = {}
_MESH_CACHE_OWNER: Optional[dist.ProcessGroup] = None  # the default group the cache belongs to
_GLOO_CACHE: dict[tuple, dict[str, dist.ProcessGroup]] = {}  # gloo groups by layout, same owner


class ModelParallelNotInitializedError(RuntimeError):
    pass


def _backend_device_type(backend: str) -> str:
    # gloo moves CPU tensors, NCCL CUDA tensors; the mesh must match or every
    # DTensor collective fails far from here.
    backend = backend.lower()
    if backend == "gloo":
        return "cpu"
    if backend in ("nccl", "cuda:nccl"):
        return "cuda"
    if "nccl" in backend:  # e.g. "cpu:gloo,cuda:nccl"
        return "cuda"
    raise ValueError(
        f"unsupported torch.distributed backend {backend!r}: megatron_fsdp supports "
        "'gloo' (CPU tensors) and 'nccl' (CUDA tensors)"
    )


def _parse_order(order: str, sizes: dict[str, int]) -> list[str]:
    if not isinstance(order, str):
        raise TypeError(f"order must be a string like 'tp-cp-ep-dp-pp', got {order!r}")
    names = order.lower().split("-")
    unknown = [n for n in names if n not in _SUPPORTED_ORDER_DIMS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"invalid order {order!r}: it must list distinct names from "
            f"{'-'.join(_SUPPORTED_ORDER_DIMS)} separated by '-'"
        )
    missing = [n for n, size in sizes.items() if size > 1 and n not in names]
    if missing:
        raise ValueError(
            f"order {order!r} does not name {', '.join(missing)}, whose size is larger than 1"
        )
    return [n for n in names if n != "ep"] + [n for n in sizes if n not in names and n != "ep"]


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_split_rank: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[list[int]] = None,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    encoder_tensor_model_parallel_size: int = 0,
    encoder_pipeline_model_parallel_size: int = 0,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    create_gloo_process_groups: bool = True,
) -> None:
    """Create the model-parallel groups (Megatron-Core's signature).

    Every argument is validated before any group is created, so a bad value
    raises the same error on every rank instead of leaving ranks waiting in a
    collective.
    """
    global _STATE
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel() needs torch.distributed to be initialized first "
            "(torch.distributed.init_process_group)"
        )
    if _STATE is not None:
        raise RuntimeError(
            "model parallel state is already initialized; call destroy_model_parallel() "
            "before initializing it again"
        )
    if isinstance(distributed_timeout_minutes, bool) or not isinstance(distributed_timeout_minutes, (int, float)) \
            or distributed_timeout_minutes <= 0:
        raise ValueError(f"distributed_timeout_minutes must be a positive number, got {distributed_timeout_minutes!r}")
    if not isinstance(create_gloo_process_groups, bool):
        raise ValueError(f"create_gloo_process_groups must be True or False, got {create_gloo_process_groups!r}")
    for name, value in (
        ("tensor_model_parallel_size", tensor_model_parallel_size),
        ("pipeline_model_parallel_size", pipeline_model_parallel_size),
        ("context_parallel_size", context_parallel_size),
        ("expert_model_parallel_size", expert_model_parallel_size),
        ("num_distributed_optimizer_instances", num_distributed_optimizer_instances),
    ):
        _check_positive_int(name, value)
    if pipeline_model_parallel_size != 1 or virtual_pipeline_model_parallel_size not in (None, 1):
        raise NotImplementedError(
            f"pipeline parallelism is not supported by megatron_fsdp: got "
            f"pipeline_model_parallel_size={pipeline_model_parallel_size}, "
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} "
            "(only 1 / None are allowed)"
        )
    if expert_model_parallel_size != 1 or expert_tensor_parallel_size not in (None, 1, tensor_model_parallel_size):
        raise NotImplementedError(
            f"expert parallelism is not supported by megatron_fsdp: got "
            f"expert_model_parallel_size={expert_model_parallel_size}, "
            f"expert_tensor_parallel_size={expert_tensor_parallel_size} (only 1 is allowed)"
        )
    unsupported = {
        "pipeline_model_parallel_split_rank": (pipeline_model_parallel_split_rank, None),
        "hierarchical_context_parallel_sizes": (hierarchical_context_parallel_sizes, None),
        "encoder_tensor_model_parallel_size": (encoder_tensor_model_parallel_size, 0),
        "encoder_pipeline_model_parallel_size": (encoder_pipeline_model_parallel_size, 0),
        "use_sharp": (use_sharp, False),
        "get_embedding_ranks": (get_embedding_ranks, None),
        "get_position_embedding_ranks": (get_position_embedding_ranks, None),
    }
    for name, (value, default) in unsupported.items():
        if value != default:
            raise NotImplementedError(
                f"{name}={value!r} is not supported by megatron_fsdp (only {default!r} is allowed)"
            )

    world_size = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * context_parallel_size
    if world_size % model_parallel != 0:
        raise RuntimeError(
            f"world size ({world_size}) is not divisible by tensor_model_parallel_size "
            f"({tensor_model_parallel_size}) x context_parallel_size ({context_parallel_size}) "
            f"x pipeline_model_parallel_size ({pipeline_model_parallel_size})"
        )
    data_parallel_size = world_size // model_parallel
    if data_parallel_size % num_distributed_optimizer_instances != 0:
        raise RuntimeError(
            f"data-parallel size ({data_parallel_size}) is not divisible by "
            f"num_distributed_optimizer_instances ({num_distributed_optimizer_instances})"
        )
    sizes = {
        "tp": tensor_model_parallel_size,
        "cp": context_parallel_size,
        "ep": expert_model_parallel_size,
        "dp": data_parallel_size,
        "pp": pipeline_model_parallel_size,
    }
    dims = _parse_order(order, sizes)
    device_type = _backend_device_type(dist.get_backend())

    # Slowest-varying dimension first; dp expands into (dp_replicate, dp_shard).
    mesh_names: list[str] = []
    mesh_shape: list[int] = []
    for name in reversed(dims):
        if name == "dp":
            mesh_names += ["dp_replicate", "dp_shard"]
            mesh_shape += [num_distributed_optimizer_instances,
                           data_parallel_size // num_distributed_optimizer_instances]
        else:
            mesh_names.append(name)
            mesh_shape.append(sizes[name])
    mesh, dim_meshes = _build_meshes(device_type, tuple(mesh_shape), tuple(mesh_names))
    timeout = datetime.timedelta(minutes=distributed_timeout_minutes)
    groups = {id(m.get_group()): m.get_group() for m in dim_meshes.values()}
    gloo_groups = _build_gloo_groups(mesh, dim_meshes, tuple(mesh_names)) if create_gloo_process_groups else None
    groups.update({id(g): g for g in (gloo_groups or {}).values()})
    for group in groups.values():
        # Megatron creates its groups with this timeout; ours may come from the
        # layout cache, so it is set (again) on every initialization.
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    _STATE = _ParallelState(
        mesh=mesh,
        dim_meshes=dim_meshes,
        device_type=device_type,
        tensor_model_parallel_size=tensor_model_parallel_size,
        context_parallel_size=context_parallel_size,
        data_parallel_size=data_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        order=order,
        gloo_groups=gloo_groups,
    )


def _build_meshes(device_type: str, shape: tuple[int, ...],
                  names: tuple[str, ...]) -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
    global _MESH_CACHE_OWNER
    default_group = dist.distributed_c10d._get_default_group()
    if _MESH_CACHE_OWNER is not default_group:
        _MESH_CACHE.clear()  # meshes of an earlier, destroyed default group
        _GLOO_CACHE.clear()
        _MESH_CACHE_OWNER = default_group
    key = (device_type, shape, names)
    if key in _MESH_CACHE:
        return _MESH_CACHE[key]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)

    def submesh(*dims: str) -> DeviceMesh:
        # DeviceMesh slices must list dims in the root mesh's order.
        return mesh[tuple(sorted(dims, key=names.index))]

    dim_meshes = {name: mesh[name] for name in names}
    dim_meshes["dp"] = submesh("dp_replicate", "dp_shard")._flatten("dp")
    dim_meshes["dp_cp"] = submesh("dp_replicate", "dp_shard", "cp")._flatten("dp_cp")
    dim_meshes["dp_shard_cp"] = submesh("dp_shard", "cp")._flatten("dp_shard_cp")
    _MESH_CACHE[key] = (mesh, dim_meshes)
    return mesh, dim_meshes


def _group_ranks(mesh_ranks: torch.Tensor, names: tuple[str, ...], dims: tuple[str, ...]) -> list[list[int]]:
    """The ranks of every group spanning `dims` of a mesh: its rank tensor
    with those dims moved last (in mesh order, as flattening orders them)."""
    inner = sorted(dims, key=names.index)
    outer = [n for n in names if n not in inner]
    ranks = mesh_ranks.permute([names.index(n) for n in outer + inner])
    return ranks.reshape(-1, math.prod(mesh_ranks.shape[names.index(n)] for n in inner)).tolist()


def _build_gloo_groups(mesh: DeviceMesh, dim_meshes: dict[str, DeviceMesh],
                       names: tuple[str, ...]) -> dict[str, dist.ProcessGroup]:
    """gloo groups over each data-parallel group's ranks (with and without
    cp), created by every rank for every group in the same order."""
    key = (tuple(mesh.mesh.shape), names)
    if key in _GLOO_CACHE:
        return _GLOO_CACHE[key]
    groups = {}
    for flat, dims in (("dp", ("dp_replicate", "dp_shard")), ("dp_cp", ("dp_replicate", "dp_shard", "cp"))):
        if dist.get_backend(dim_meshes[flat].get_group()) == "gloo":
            groups[flat] = dim_meshes[flat].get_group()  # already a gloo group over these ranks
            continue
        group, _ = dist.new_subgroups_by_enumeration(_group_ranks(mesh.mesh, names, dims), backend="gloo")
        groups[flat] = group
    _GLOO_CACHE[key] = groups
    return groups


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def is_initialized() -> bool:
    """Megatron's name for code that runs with or without model parallelism."""
    return _STATE is not None


def _state() -> _ParallelState:
    if _STATE is None:
        raise ModelParallelNotInitializedError(
            "model parallel state is not initialized: call "
            "megatron_fsdp.parallel_state.initialize_model_parallel() first"
        )
    return _STATE


def destroy_model_parallel() -> None:
    """Drop the model-parallel state; `initialize_model_parallel` may be called again.

    Safe to call when nothing is initialized. The process groups stay alive
    for reuse (see _MESH_CACHE) and are freed by
    `torch.distributed.destroy_process_group()`.
    """
    global _STATE
    if _STATE is None:
        return
    _STATE = None
    from . import tensor_parallel  # local import: tensor_parallel imports this module

    tensor_parallel.random.get_cuda_rng_tracker().reset()


# ---------------------------------------------------------------- DeviceMesh


def get_device_mesh() -> DeviceMesh:
    """The root mesh, dims named pp, dp_replicate, dp_shard, cp, tp (in order's layout).

    Flattened views (dp, dp_cp, dp_shard_cp) come from `get_data_parallel_mesh`
    and friends, not from slicing this mesh."""
    return _state().mesh


def get_device_type() -> str:
    """"cpu" with gloo, "cuda" with NCCL: where parameters and activations live."""
    return _state().device_type


def get_device() -> torch.device:
    if get_device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_tensor_model_parallel_mesh() -> DeviceMesh:
    return _state().dim_meshes["tp"]


def get_data_parallel_group_gloo(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """A gloo group over this rank's data-parallel ranks (Megatron's name)."""
    groups = _state().gloo_groups
    if groups is None:
        raise RuntimeError("the data-parallel gloo groups were not created: initialize_model_parallel("
                           "create_gloo_process_groups=True) creates them")
    return groups["dp_cp" if with_context_parallel else "dp"]


def get_data_parallel_mesh(with_context_parallel: bool = False) -> DeviceMesh:
    return _state().dim_meshes["dp_cp" if with_context_parallel else "dp"]


def get_hybrid_data_parallel_mesh() -> DeviceMesh:
    """2D (dp_replicate, dp_shard) mesh for HSDP: replicated across
    distributed-optimizer instances, sharded within one."""
    state = _state()
    if state.context_parallel_size > 1:
        raise NotImplementedError("HSDP with context parallelism is not supported")
    names = state.mesh.mesh_dim_names
    return state.mesh[tuple(sorted(("dp_replicate", "dp_shard"), key=names.index))]


# ------------------------------------------------------------ Megatron getters


def _group(dim: str) -> dist.ProcessGroup:
    return _state().dim_meshes[dim].get_group()


def _rank(dim: str) -> int:
    return _state().dim_meshes[dim].get_local_rank()


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _group("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _state().tensor_model_parallel_size


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return dist.get_global_rank(get_tensor_model_parallel_group(), 0)


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _group("cp")


def get_context_parallel_world_size() -> int:
    return _state().context_parallel_size


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int]:
    return dist.get_process_group_ranks(get_context_parallel_group())


def get_data_parallel_group(with_context_parallel: bool = False,
                            partial_data_parallel: bool = False) -> dist.ProcessGroup:
    if partial_data_parallel:
        return get_intra_distributed_optimizer_instance_group() if with_context_parallel else _group("dp_shard")
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False,
                                 partial_data_parallel: bool = False) -> int:
    state = _state()
    size = state.data_parallel_size
    if partial_data_parallel:
        size //= state.num_distributed_optimizer_instances
    return size * (state.context_parallel_size if with_context_parallel else 1)


def get_data_parallel_rank(with_context_parallel: bool = False,
                           partial_data_parallel: bool = False) -> int:
    if partial_data_parallel:
        return _rank("dp_shard_cp") if with_context_parallel else _rank("dp_shard")
    return _rank("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return dist.get_global_rank(get_data_parallel_group(with_context_parallel), 0)


def get_intra_distributed_optimizer_instance_group() -> dist.ProcessGroup:
    """The data x context parallel ranks of one distributed-optimizer instance."""
    return _group("dp_shard_cp")


def get_inter_distributed_optimizer_instance_group() -> dist.ProcessGroup:
    """The ranks holding the same shard in different distributed-optimizer instances."""
    return _group("dp_replicate")


def get_num_distributed_optimizer_instances() -> int:
    return _state().num_distributed_optimizer_instances


def get_pipeline_model_parallel_world_size() -> int:
    _state()
    return 1


def get_pipeline_model_parallel_rank() -> int:
    _state()
    return 0


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return _group("pp")


def is_pipeline_first_stage(ignore_virtual: bool = True) -> bool:
    _state()
    return True


def is_pipeline_last_stage(ignore_virtual: bool = True) -> bool:
    _state()
    return True


def get_expert_model_parallel_world_size() -> int:
    _state()
    return 1


def get_model_parallel_group() -> dist.ProcessGroup:
    """Tensor x pipeline model-parallel group; pipeline size is always 1 here."""
    return get_tensor_model_parallel_group()
