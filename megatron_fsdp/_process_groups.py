"""DeviceMesh and process-group construction behind megatron_fsdp.parallel_state.

Kept apart from parallel_state so that module holds the state and Megatron's
getters only. Nothing here is public API.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from . import _torch_compat
from .utils import check_hierarchical_sizes, check_positive_int, reject_unsupported

SUPPORTED_ORDER_DIMS = ("tp", "cp", "ep", "dp", "pp")

# Flattened views built on every mesh, as (name, root dims it spans). Megatron
# builds a group for each of these; so does every rank here, in this order.
FLATTENED_DIMS = (
    ("dp", ("dp_replicate", "dp_shard")),
    ("dp_cp", ("dp_replicate", "dp_shard", "cp")),
    ("dp_shard_cp", ("dp_shard", "cp")),
    ("tp_cp", ("cp", "tp")),
    ("tp_dp", ("dp_replicate", "dp_shard", "tp")),
    ("tp_dp_cp", ("dp_replicate", "dp_shard", "cp", "tp")),
)

# The expert layout (Megatron's expert RankGenerator: the order's "tp" is the expert tensor-parallel
# size, "dp" the expert data-parallel size, no "cp"): its root mesh's dims and flattened views.
EXPERT_DIM_NAMES = {"tp": "etp", "ep": "ep", "dp": "expt_dp"}
EXPERT_FLATTENED_DIMS = (("ep_etp", ("ep", "etp")),)

# gloo groups over the data-parallel ranks (Megatron's *_GLOO groups): the
# flattened view whose ranks each one spans.
GLOO_DIMS = ("dp", "dp_cp", "dp_shard_cp")

# DeviceMeshes built so far, by (device type, shape, names).
# DTensor caches sharding decisions keyed by mesh *equality*, so a DTensor op
# after a re-initialization can be handed an earlier, equal mesh: its process
# groups must still be alive. Re-initializing with a layout seen before
# therefore reuses its mesh, and groups are never destroyed while the default
# process group lives. The cache lets go of them (release_meshes) at shutdown,
# or at the latest when a later initialization finds a new default group.
_MESH_CACHE: dict[tuple, tuple[DeviceMesh, dict[str, DeviceMesh]]] = {}
_MESH_CACHE_OWNER: Optional[dist.ProcessGroup] = None  # the default group the cache belongs to
_GLOO_CACHE: dict[tuple, dict[str, dist.ProcessGroup]] = {}  # gloo groups by layout, same owner
_HIERARCHICAL_CACHE: dict[tuple, list[dist.ProcessGroup]] = {}  # hierarchical CP groups by layout, same owner


def backend_device_type(backend: str) -> str:
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


def parse_order(order: str, sizes: dict[str, int]) -> list[str]:
    if not isinstance(order, str):
        raise TypeError(f"order must be a string like 'tp-cp-ep-dp-pp', got {order!r}")
    names = order.lower().split("-")
    unknown = [n for n in names if n not in SUPPORTED_ORDER_DIMS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"invalid order {order!r}: it must list distinct names from "
            f"{'-'.join(SUPPORTED_ORDER_DIMS)} separated by '-'"
        )
    missing = [n for n, size in sizes.items() if size > 1 and n not in names]
    if missing:
        raise ValueError(
            f"order {order!r} does not name {', '.join(missing)}, whose size is larger than 1"
        )
    return [n for n in names if n != "ep"] + [n for n in sizes if n not in names and n != "ep"]


def check_initialize_arguments(*, tensor_model_parallel_size, pipeline_model_parallel_size,
                               virtual_pipeline_model_parallel_size, pipeline_model_parallel_split_rank,
                               pipeline_model_parallel_comm_backend, use_sharp, context_parallel_size,
                               hierarchical_context_parallel_sizes, expert_model_parallel_size,
                               num_distributed_optimizer_instances, expert_tensor_parallel_size,
                               nccl_communicator_config_path, distributed_timeout_minutes,
                               encoder_tensor_model_parallel_size, encoder_pipeline_model_parallel_size,
                               get_embedding_ranks, get_position_embedding_ranks,
                               create_gloo_process_groups, world_size: int) -> int:
    """Every check of initialize_model_parallel's arguments, made before any
    group exists so a bad value raises on every rank; returns the data-parallel size."""
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
        check_positive_int(name, value)
    no_pipeline = "there is no pipeline parallelism"
    reject_unsupported("initialize_model_parallel", {
        "pipeline_model_parallel_size": (pipeline_model_parallel_size, 1, no_pipeline),
        "virtual_pipeline_model_parallel_size": (
            1 if virtual_pipeline_model_parallel_size is None else virtual_pipeline_model_parallel_size, 1,
            no_pipeline + " (None also means none)"),
        "pipeline_model_parallel_split_rank": (pipeline_model_parallel_split_rank, None, no_pipeline),
        # There is no pipeline communication to give a backend to.
        "pipeline_model_parallel_comm_backend": (pipeline_model_parallel_comm_backend, None, no_pipeline),
        "encoder_tensor_model_parallel_size": (encoder_tensor_model_parallel_size, 0,
                                               "there is no encoder parallelism"),
        "encoder_pipeline_model_parallel_size": (encoder_pipeline_model_parallel_size, 0,
                                                 "there is no encoder parallelism"),
        "use_sharp": (use_sharp, False, "SHARP is not used"),
        "nccl_communicator_config_path": (nccl_communicator_config_path, None,
                                          "NCCL communicator options (a YAML file) are not applied to "
                                          "megatron_fsdp's groups"),
        "get_embedding_ranks": (get_embedding_ranks, None,
                                "with one pipeline stage the embedding group is this rank alone"),
        "get_position_embedding_ranks": (get_position_embedding_ranks, None,
                                         "with one pipeline stage the position-embedding group is this rank alone"),
    })

    check_hierarchical_sizes(hierarchical_context_parallel_sizes, context_parallel_size)
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
    if expert_tensor_parallel_size is not None:
        check_positive_int("expert_tensor_parallel_size", expert_tensor_parallel_size)
    expert_model_parallel = (expert_tensor_parallel_size or tensor_model_parallel_size) * expert_model_parallel_size
    if world_size % expert_model_parallel != 0:
        raise RuntimeError(f"world size ({world_size}) is not divisible by expert_tensor_parallel_size "
                           f"({expert_tensor_parallel_size or tensor_model_parallel_size}) x "
                           f"expert_model_parallel_size ({expert_model_parallel_size})")
    if expert_model_parallel_size > 1 and num_distributed_optimizer_instances > 1:
        raise NotImplementedError("expert_model_parallel_size > 1 with num_distributed_optimizer_instances > 1 "
                                  "(HSDP) is not supported: the experts shard over their whole data-parallel group")
    return data_parallel_size


def build_hierarchical_cp_groups(mesh: DeviceMesh, names: tuple[str, ...],
                                 sizes: tuple[int, ...]) -> list[dist.ProcessGroup]:
    """This rank's group at each level of hierarchical context parallelism (Megatron's layout).

    Within a CP group of ranks g0..g(P-1), level k's groups hold `sizes[k]` ranks a stride of
    prod(sizes[:k]) apart: with sizes (2, 2), level 0 is [g0, g1], [g2, g3] (the a2a groups of
    a2a+p2p: neighbours) and level 1 is [g0, g2], [g1, g3] (the p2p rings). Every rank creates
    every group, in the same order."""
    key = (tuple(mesh.mesh.shape), names, tuple(sizes))
    if key in _HIERARCHICAL_CACHE:
        return _HIERARCHICAL_CACHE[key]
    cp_groups = torch.tensor(group_ranks(mesh.mesh, names, ("cp",)))  # [groups, P]
    mine = []
    for level, size in enumerate(sizes):
        inner = math.prod(sizes[:level])
        # NOTE: "(l s u) -> (l u) s": a level's ranks are `inner` apart within their CP group.
        rows = cp_groups.reshape(len(cp_groups), -1, size, inner).transpose(2, 3).reshape(-1, size).tolist()
        group, _ = dist.new_subgroups_by_enumeration(rows)
        mine.append(group)
    _HIERARCHICAL_CACHE[key] = mine
    return mine


def expert_mesh_layout(order: str, sizes: dict[str, int]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The expert root mesh's dim names and shape, slowest-varying first, from Megatron's `order`
    (fastest first): with the default "tp-cp-ep-dp-pp", etp fastest, then ep, then expt_dp.
    `sizes` by expert dim name."""
    fast_first = [EXPERT_DIM_NAMES[n] for n in order.lower().split("-") if n in EXPERT_DIM_NAMES]
    fast_first += [n for n in ("etp", "ep", "expt_dp") if n not in fast_first]
    names = tuple(reversed(fast_first))
    return names, tuple(sizes[n] for n in names)


def build_meshes(device_type: str, shape: tuple[int, ...], names: tuple[str, ...],
                 flattened: tuple = FLATTENED_DIMS) -> tuple[DeviceMesh, dict[str, DeviceMesh]]:
    """The root mesh and every 1D view by name: the root's dims and the `flattened` ones
    (FLATTENED_DIMS for the dense layout, EXPERT_FLATTENED_DIMS for the experts')."""
    global _MESH_CACHE_OWNER
    default_group = _torch_compat.default_group()
    if _MESH_CACHE_OWNER is not default_group:
        if _MESH_CACHE_OWNER is not None:  # meshes of an earlier, destroyed default group
            release_meshes()
        _MESH_CACHE_OWNER = default_group
    key = (device_type, shape, names)
    if key in _MESH_CACHE:
        return _MESH_CACHE[key]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    dim_meshes = {name: mesh[name] for name in names}
    for flat, dims in flattened:
        # DeviceMesh slices must list dims in the root mesh's order.
        dim_meshes[flat] = _torch_compat.flatten_mesh(mesh[tuple(sorted(dims, key=names.index))], flat)
    _MESH_CACHE[key] = (mesh, dim_meshes)
    return mesh, dim_meshes


def release_meshes() -> None:
    """Drop every cached mesh and gloo group, for a default group that is being (or has been)
    destroyed. torch frees a group, with its threads and sockets, only when nothing refers to
    it, and DTensor's caches keep meshes for the rest of the process: the meshes let go of their
    groups first. Without this, each pretrain() in one process left its groups behind: 30-60
    threads per job at 4 ranks, all of them waking now and then."""
    global _MESH_CACHE_OWNER
    for mesh, dim_meshes in _MESH_CACHE.values():
        for m in (mesh, *dim_meshes.values()):
            _torch_compat.drop_mesh_process_groups(m)  # DTensor's own caches keep meshes
    _MESH_CACHE.clear()
    _GLOO_CACHE.clear()
    _HIERARCHICAL_CACHE.clear()
    # And DTensor's specs and plans that may still name them, or the groups of meshes a user made
    # (the fully_shard API takes any DeviceMesh): equal meshes of the next group would find them.
    _torch_compat.clear_dtensor_sharding_caches()
    _MESH_CACHE_OWNER = None


def group_ranks(mesh_ranks: torch.Tensor, names: tuple[str, ...], dims: tuple[str, ...]) -> list[list[int]]:
    """The ranks of every group spanning `dims` of a mesh: its rank tensor
    with those dims moved last (in mesh order, as flattening orders them)."""
    inner = sorted(dims, key=names.index)
    outer = [n for n in names if n not in inner]
    ranks = mesh_ranks.permute([names.index(n) for n in outer + inner])
    return ranks.reshape(-1, math.prod(mesh_ranks.shape[names.index(n)] for n in inner)).tolist()


def build_gloo_groups(mesh: DeviceMesh, dim_meshes: dict[str, DeviceMesh],
                      names: tuple[str, ...]) -> dict[str, dist.ProcessGroup]:
    """gloo groups over the ranks of each GLOO_DIMS view, created by every
    rank for every group in the same order."""
    key = (tuple(mesh.mesh.shape), names)
    if key in _GLOO_CACHE:
        return _GLOO_CACHE[key]
    spans = dict(FLATTENED_DIMS)
    groups = {}
    built: list[tuple[list[list[int]], dist.ProcessGroup]] = []
    for flat in GLOO_DIMS:
        if dist.get_backend(dim_meshes[flat].get_group()) == "gloo":
            groups[flat] = dim_meshes[flat].get_group()  # already a gloo group over these ranks
            continue
        rows = group_ranks(mesh.mesh, names, spans[flat])
        members = sorted(sorted(row) for row in rows)
        # Views that span the same ranks (dp and dp_cp without cp, say) share one group.
        same = [group for other, group in built if other == members]
        if same:
            groups[flat] = same[0]
            continue
        groups[flat], _ = dist.new_subgroups_by_enumeration(rows, backend="gloo")
        built.append((members, groups[flat]))
    _GLOO_CACHE[key] = groups
    return groups
