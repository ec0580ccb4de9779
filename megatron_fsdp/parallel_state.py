"""Model-parallel process groups, built on one DeviceMesh.

Megatron-Core keeps dozens of module-level globals for its groups. Here one
frozen `_ParallelState` holds the root DeviceMesh and everything derived from
it; the Megatron getters read from it. Code that wants DTensor asks for the
mesh itself (`get_device_mesh()`, `get_tensor_model_parallel_mesh()`, ...).

Mesh dimensions, slowest-varying first, follow the reversed `order` string
(Megatron's rank layout: the first name in `order` varies fastest). The
data-parallel dimension is split into ``dp_replicate`` (one entry per
distributed-optimizer instance) and ``dp_shard`` so HSDP can use it as 2D.
Flattened views: ``dp`` (= dp_replicate x dp_shard), ``dp_cp``,
``dp_shard_cp`` (the ranks of one distributed-optimizer instance), ``tp_cp``,
``tp_dp`` and ``tp_dp_cp``. Pipeline parallelism is not supported: ``pp`` is
a size-1 dim, so the pipeline, embedding and position-embedding groups are
each rank alone, as Megatron's are with one stage.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._process_groups import (
    backend_device_type as _backend_device_type,
    build_gloo_groups as _build_gloo_groups,
    build_hierarchical_cp_groups as _build_hierarchical_cp_groups,
    build_meshes as _build_meshes,
    EXPERT_FLATTENED_DIMS as _EXPERT_FLATTENED_DIMS,
    expert_mesh_layout as _expert_mesh_layout,
    check_initialize_arguments as _check_initialize_arguments,
    parse_order as _parse_order,
)
from . import _torch_compat
from .utils import reject_unsupported as _reject_unsupported
from .utils import serve_context_parallel_group as _serve_context_parallel_group


@dataclasses.dataclass(frozen=True)
class _ParallelState:
    mesh: DeviceMesh
    # 1D meshes by name: the root's dims and the flattened views
    # (_process_groups.FLATTENED_DIMS). Flattened views are kept here because
    # slicing them from the root is deprecated.
    dim_meshes: dict[str, DeviceMesh]
    device_type: str
    tensor_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    num_distributed_optimizer_instances: int
    order: str
    # gloo groups over the same ranks as "dp", "dp_cp" and "dp_shard_cp"
    # (Megatron's *_gloo groups, for CPU-side work); None unless asked for.
    gloo_groups: Optional[dict[str, dist.ProcessGroup]] = None
    # This rank's group at each level of hierarchical_context_parallel_sizes (a2a+p2p: the a2a
    # group, then the p2p ring); None when none were asked for.
    hierarchical_context_parallel_groups: Optional[list[dist.ProcessGroup]] = None
    # The experts' layout (Megatron's expert RankGenerator): a root mesh over every rank with dims
    # expt_dp, ep, etp (in `order`'s nesting) and its 1D views by name (and "ep_etp").
    expert_mesh: Optional[DeviceMesh] = None
    expert_dim_meshes: Optional[dict[str, DeviceMesh]] = None


_STATE: Optional[_ParallelState] = None
# What destroy_model_parallel also drops, registered by the modules that keep state tied to the
# groups (tensor_parallel.random's RNG tracker): they import this module, never the reverse.
_ON_DESTROY: list[Callable[[], None]] = []


def on_destroy_model_parallel(reset: Callable[[], None]) -> Callable[[], None]:
    """Call `reset()` each time destroy_model_parallel drops the state; returns it."""
    if reset not in _ON_DESTROY:
        _ON_DESTROY.append(reset)
    return reset


class ModelParallelNotInitializedError(RuntimeError):
    pass


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
    data_parallel_size = _check_initialize_arguments(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        use_sharp=use_sharp, context_parallel_size=context_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        expert_model_parallel_size=expert_model_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        nccl_communicator_config_path=nccl_communicator_config_path,
        distributed_timeout_minutes=distributed_timeout_minutes,
        encoder_tensor_model_parallel_size=encoder_tensor_model_parallel_size,
        encoder_pipeline_model_parallel_size=encoder_pipeline_model_parallel_size,
        get_embedding_ranks=get_embedding_ranks, get_position_embedding_ranks=get_position_embedding_ranks,
        create_gloo_process_groups=create_gloo_process_groups, world_size=dist.get_world_size())
    sizes = {
        "tp": tensor_model_parallel_size,
        "cp": context_parallel_size,
        "ep": expert_model_parallel_size,
        "dp": data_parallel_size,
        "pp": pipeline_model_parallel_size,
    }
    dims = _parse_order(order, sizes)
    device_type = _backend_device_type(dist.get_backend())
    _torch_compat.warn_if_unsupported_torch()

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
    expert_tp = expert_tensor_parallel_size or tensor_model_parallel_size
    expert_names, expert_shape = _expert_mesh_layout(order, {
        "etp": expert_tp, "ep": expert_model_parallel_size,
        "expt_dp": dist.get_world_size() // (expert_tp * expert_model_parallel_size)})
    expert_mesh, expert_dim_meshes = _build_meshes(device_type, expert_shape, expert_names, _EXPERT_FLATTENED_DIMS)
    groups.update({id(m.get_group()): m.get_group() for m in expert_dim_meshes.values()})
    hierarchical = None
    if hierarchical_context_parallel_sizes is not None:
        hierarchical = _build_hierarchical_cp_groups(mesh, tuple(mesh_names),
                                                     tuple(hierarchical_context_parallel_sizes))
        groups.update({id(g): g for g in hierarchical})
    for group in groups.values():
        # Megatron creates its groups with this timeout; ours may come from the
        # layout cache, so it is set (again) on every initialization.
        _torch_compat.set_group_timeout(group, timeout)
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
        hierarchical_context_parallel_groups=hierarchical,
        expert_mesh=expert_mesh,
        expert_dim_meshes=expert_dim_meshes,
    )


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
    for reuse (see _process_groups._MESH_CACHE) and are freed by
    `torch.distributed.destroy_process_group()`.
    """
    global _STATE
    if _STATE is None:
        return
    _STATE = None
    for reset in _ON_DESTROY:
        reset()


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


def get_device_or_cpu() -> torch.device:
    """get_device() once model parallelism is initialized, the CPU before (a
    collective of a plain gloo job, a check run before start-up)."""
    return get_device() if model_parallel_is_initialized() else torch.device("cpu")


def get_tensor_model_parallel_mesh() -> DeviceMesh:
    return _state().dim_meshes["tp"]


def get_data_parallel_mesh(with_context_parallel: bool = False) -> DeviceMesh:
    return _state().dim_meshes["dp_cp" if with_context_parallel else "dp"]


def get_hybrid_data_parallel_mesh() -> DeviceMesh:
    """2D (dp_replicate, dp_shard) mesh for HSDP: replicated across
    distributed-optimizer instances, sharded within one."""
    state = _state()
    _reject_unsupported("parallel_state.get_hybrid_data_parallel_mesh", {
        "context_parallel_size": (state.context_parallel_size, 1, "HSDP with context parallelism is not supported")})
    names = state.mesh.mesh_dim_names
    return state.mesh[tuple(sorted(("dp_replicate", "dp_shard"), key=names.index))]


# ------------------------------------------------------------ Megatron getters


def _group(dim: str, check_initialized: bool = True) -> Optional[dist.ProcessGroup]:
    # Megatron's check_initialized=False returns its (None) global instead of asserting.
    if _STATE is None and not check_initialized:
        return None
    return _state().dim_meshes[dim].get_group()


def _rank(dim: str) -> int:
    return _state().dim_meshes[dim].get_local_rank()


def get_tensor_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _group("tp", check_initialized)


def get_tensor_model_parallel_world_size() -> int:
    return _state().tensor_model_parallel_size


def get_tensor_model_parallel_rank() -> int:
    return _rank("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in this rank's TP group."""
    return dist.get_global_rank(get_tensor_model_parallel_group(), 0)


def get_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    """Tensor x pipeline model-parallel group; pipeline size is always 1 here."""
    return _group("tp", check_initialized)


def get_model_parallel_src_rank() -> int:
    return dist.get_global_rank(get_model_parallel_group(), 0)


def get_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _group("cp", check_initialized)


_serve_context_parallel_group(get_context_parallel_group)  # utils.get_batch_on_this_cp_rank's default


def get_hierarchical_context_parallel_groups(check_initialized: bool = True) -> Optional[list[dist.ProcessGroup]]:
    """This rank's group at each level of `hierarchical_context_parallel_sizes` (a2a+p2p: its a2a
    group, then its p2p ring), Megatron's getter; None when no sizes were given."""
    if _STATE is None and not check_initialized:
        return None
    groups = _state().hierarchical_context_parallel_groups
    if groups is None and check_initialized:
        raise RuntimeError("no hierarchical context-parallel groups: initialize_model_parallel was called "
                           "without hierarchical_context_parallel_sizes")
    return groups


def get_context_parallel_world_size() -> int:
    return _state().context_parallel_size


def get_context_parallel_rank() -> int:
    return _rank("cp")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> Optional[list[int]]:
    group = get_context_parallel_group(check_initialized)
    return None if group is None else dist.get_process_group_ranks(group)


def get_tensor_and_context_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _group("tp_cp", check_initialized)


def get_tensor_and_context_parallel_world_size() -> int:
    state = _state()
    return state.tensor_model_parallel_size * state.context_parallel_size


def get_tensor_and_context_parallel_rank() -> int:
    return dist.get_rank(get_tensor_and_context_parallel_group())


def get_tensor_and_data_parallel_group(check_initialized: bool = True,
                                       with_context_parallel: bool = False) -> dist.ProcessGroup:
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_amax_reduction_group(with_context_parallel: bool = False,
                             tp_only_amax_red: bool = False) -> dist.ProcessGroup:
    """The group fp8 amax values are reduced over (Megatron's choice of group)."""
    if tp_only_amax_red:
        return _group("tp_cp" if with_context_parallel else "tp")
    return get_tensor_and_data_parallel_group(with_context_parallel=with_context_parallel)


def _check_gtp_remat(with_gtp_remat) -> None:
    # Megatron's generalized-TP weight-rematerialization axis has size 1 here,
    # so its "replicate" and "full" data-parallel groups are the same group.
    if not isinstance(with_gtp_remat, bool):
        raise ValueError(f"with_gtp_remat must be True or False, got {with_gtp_remat!r}")


def get_data_parallel_group(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                            partial_data_parallel: bool = False) -> dist.ProcessGroup:
    _check_gtp_remat(with_gtp_remat)
    if partial_data_parallel:
        return get_intra_distributed_optimizer_instance_group() if with_context_parallel else _group("dp_shard")
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_group_gloo(with_context_parallel: bool = False,
                                 partial_data_parallel: bool = False) -> dist.ProcessGroup:
    """A gloo group over the ranks of `get_data_parallel_group` with the same arguments."""
    if partial_data_parallel and not with_context_parallel:
        raise ValueError("get_data_parallel_group_gloo: partial_data_parallel=True needs "
                         "with_context_parallel=True (Megatron's rule: an optimizer instance includes CP)")
    groups = _state().gloo_groups
    if groups is None:
        raise RuntimeError("the data-parallel gloo groups were not created: initialize_model_parallel("
                           "create_gloo_process_groups=True) creates them")
    if partial_data_parallel:
        return groups["dp_shard_cp"]
    return groups["dp_cp" if with_context_parallel else "dp"]


def get_data_parallel_world_size(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                                 partial_data_parallel: bool = False) -> int:
    _check_gtp_remat(with_gtp_remat)
    state = _state()
    size = state.data_parallel_size
    if partial_data_parallel:
        size //= state.num_distributed_optimizer_instances
    return size * (state.context_parallel_size if with_context_parallel else 1)


def get_data_parallel_rank(with_context_parallel: bool = False, with_gtp_remat: bool = True,
                           partial_data_parallel: bool = False) -> int:
    _check_gtp_remat(with_gtp_remat)
    if partial_data_parallel:
        return _rank("dp_shard_cp") if with_context_parallel else _rank("dp_shard")
    return _rank("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return dist.get_global_rank(get_data_parallel_group(with_context_parallel), 0)


def get_intra_distributed_optimizer_instance_group(check_initialized: bool = True) -> dist.ProcessGroup:
    """The data x context parallel ranks of one distributed-optimizer instance."""
    return _group("dp_shard_cp", check_initialized)


def get_inter_distributed_optimizer_instance_group(check_initialized: bool = True) -> dist.ProcessGroup:
    """The ranks holding the same shard in different distributed-optimizer instances."""
    return _group("dp_replicate", check_initialized)


def get_num_distributed_optimizer_instances() -> int:
    return _state().num_distributed_optimizer_instances


# ------------------------------------------- pipeline: always one stage here


def _check_vp_stage(vp_stage) -> None:
    # None and 0 both name the one stage there is.
    _reject_unsupported("parallel_state", {"vp_stage": (0 if vp_stage is None else vp_stage, 0,
                                                 "there is no virtual pipeline parallelism")})


def get_pipeline_model_parallel_world_size() -> int:
    _state()
    return 1


def get_pipeline_model_parallel_rank() -> int:
    _state()
    return 0


def get_pipeline_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _group("pp", check_initialized)


def _only_stage_rank() -> int:
    return dist.get_global_rank(get_pipeline_model_parallel_group(), 0)


def get_pipeline_model_parallel_first_rank() -> int:
    return _only_stage_rank()


def get_pipeline_model_parallel_last_rank() -> int:
    return _only_stage_rank()


def get_pipeline_model_parallel_next_rank() -> int:
    """In a one-stage pipeline the next stage (modulo the stage count, as in Megatron) is this one."""
    return _only_stage_rank()


def get_pipeline_model_parallel_prev_rank() -> int:
    return _only_stage_rank()


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """None: virtual pipelining is off (Megatron's value when it is not set)."""
    return None


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return None


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    _check_vp_stage(vp_stage)
    _state()
    return True


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    _check_vp_stage(vp_stage)
    _state()
    return True


def get_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup:
    """The ranks holding word embeddings: the first and last stage of this
    rank's pipeline, which with one stage is this rank alone (Megatron's too)."""
    return _group("pp", check_initialized)


def get_position_embedding_group(check_initialized: bool = True) -> dist.ProcessGroup:
    """The first stage of this rank's pipeline: this rank alone."""
    return _group("pp", check_initialized)


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    # As Megatron: False before initialization, then every rank (each is the first and last stage).
    _check_vp_stage(vp_stage)
    return _STATE is not None


def is_rank_in_position_embedding_group() -> bool:
    return _STATE is not None


# ---------------------------------------------------------------- experts (MoE)
# Megatron's expert layout: world = expert TP x EP x expert DP, expert TP fastest (as the dense
# TP), then EP, then expert DP, which spans the dense DP and CP ranks alike.


def get_expert_device_mesh() -> DeviceMesh:
    """The experts' root mesh, dims ("expt_dp", "ep", "etp") (NVIDIA Megatron-FSDP's expt_device_mesh)."""
    return _state().expert_mesh


def get_expert_data_parallel_mesh() -> DeviceMesh:
    """The 1D mesh FSDP shards expert parameters over."""
    return _state().expert_dim_meshes["expt_dp"]


def get_expert_model_parallel_mesh() -> DeviceMesh:
    """The 2D (ep, etp) mesh expert parameters are DTensors on."""
    return _state().expert_mesh["ep", "etp"]


def _expert_group(dim: str, check_initialized: bool) -> Optional[dist.ProcessGroup]:
    if _STATE is None and not check_initialized:
        return None
    return _state().expert_dim_meshes[dim].get_group()


def get_expert_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _expert_group("ep", check_initialized)


def get_expert_model_parallel_world_size() -> int:
    return _state().expert_dim_meshes["ep"].size()


def get_expert_model_parallel_rank() -> int:
    return _state().expert_dim_meshes["ep"].get_local_rank()


def get_expert_model_parallel_src_rank() -> int:
    return dist.get_global_rank(get_expert_model_parallel_group(), 0)


def get_expert_tensor_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _expert_group("etp", check_initialized)


def get_expert_tensor_parallel_world_size() -> int:
    return _state().expert_dim_meshes["etp"].size()


def get_expert_tensor_parallel_rank() -> int:
    return _state().expert_dim_meshes["etp"].get_local_rank()


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True) -> dist.ProcessGroup:
    return _expert_group("ep_etp", check_initialized)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _state().expert_dim_meshes["ep_etp"].size()


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _state().expert_dim_meshes["ep_etp"].get_local_rank()


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True,
                                                    with_egtp_remat: bool = False) -> dist.ProcessGroup:
    """With one pipeline stage: the expert tensor x model parallel group."""
    return get_expert_tensor_and_model_parallel_group(check_initialized)


def get_expert_data_parallel_group(check_initialized: bool = True, with_gtp_remat: bool = True,
                                   partial_expert_data_parallel: bool = False) -> dist.ProcessGroup:
    # NOTE: one distributed-optimizer instance with experts (HSDP + EP is refused), so the partial
    # expert data-parallel group is the whole one.
    _check_gtp_remat(with_gtp_remat)
    return _expert_group("expt_dp", check_initialized)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel: bool = False) -> dist.ProcessGroup:
    group = get_expert_data_parallel_group()
    if dist.get_backend(group) != "gloo":
        raise RuntimeError("the expert data-parallel gloo group is not created with NCCL: use "
                           "get_expert_data_parallel_group()")
    return group


def get_expert_data_parallel_rank(with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False) -> int:
    _check_gtp_remat(with_gtp_remat)
    return _state().expert_dim_meshes["expt_dp"].get_local_rank()


def get_expert_data_parallel_world_size(with_gtp_remat: bool = True,
                                        partial_expert_data_parallel: bool = False) -> int:
    _check_gtp_remat(with_gtp_remat)
    return _state().expert_dim_meshes["expt_dp"].size()


def get_all_ranks() -> str:
    """This rank's tensor, GTP-remat, data, context, pipeline and expert
    parallel ranks joined by "_" (Megatron's tag for per-rank files)."""
    ranks = (get_tensor_model_parallel_rank(), 0, get_data_parallel_rank(), get_context_parallel_rank(),
             get_pipeline_model_parallel_rank(), get_expert_model_parallel_rank())
    return "_".join(str(r) for r in ranks)
