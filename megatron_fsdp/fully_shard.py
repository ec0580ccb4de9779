"""NVIDIA Megatron-FSDP's `fully_shard` API for any `torch.nn.Module`, on PyTorch FSDP2.

    model, optimizer = fully_shard(model, optimizer, fsdp_unit_modules=[Block])

`fully_shard_model` plans and applies the same FSDP plan as Megatron-Core's
`TorchFullyShardedDataParallel` (distributed/fsdp_plan.py: units, mesh,
precision) and returns a `MegatronFSDP`; `fully_shard_optimizer` points the
optimizer at the sharded parameters. Every argument of NVIDIA's 0.6.1
signature is accepted by name and either honoured or refused with an error
naming it, raised before any communication, on every rank alike.

`zero_dp_strategy` (a number or a name) on FSDP2:
  0 no_shard            a (data-parallel, 1) mesh: parameters, gradients and
                        optimizer state replicated, gradients all-reduced (DDP)
  1 optim               parameters kept gathered from forward through
  2 optim_grads         backward, gradients and optimizer state sharded. FSDP2
                        always shards gradients: "optim" uses the memory of
                        "optim_grads", no more than it promises, same training
  3 optim_grads_params  everything sharded, parameters gathered per unit
  (with tensor parallelism, no_shard's mesh is (data-parallel, 1, tp) over the
  user's ranks, beside which FSDP2 keeps the tensor-parallel mesh)
`outer_dp_sharding_strategy`, with `dp_outer_dim`:
  0 no_shard  HSDP: replicas of the sharded model across the outer dimension
  1 optim     HFSDP: FSDP2 shards over the inner dimension only, and the
              optimizer steps this rank's piece of each shard
              (distributed/outer_sharding.py): its state and gradients are
              sharded across both dimensions
"""

from __future__ import annotations

import importlib
import inspect
from typing import Optional, Sequence, Type

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as _FSDP2Policy
from torch.distributed.tensor import DTensor

from . import _torch_compat, parallel_state
from ._process_groups import backend_device_type
from .distributed.fsdp_plan import (FSDPPlan, _expert_units, _materialization_device, _units, apply_fsdp_plan,
                                    experts_share_dense_layout)
from .distributed.outer_sharding import OuterShardedOptimizerState
from .distributed.torch_fully_sharded_data_parallel import broadcast_fsdp_params
from .initialization import has_recorded_parameters, initialize_parameters, unrecorded_parameters_of_layers
from .megatron_fsdp import MegatronFSDP
from .mixed_precision import MixedPrecisionPolicy

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")

# NVIDIA's arguments FSDP2 has no counterpart for: accepted at their defaults, refused otherwise.
_UNSUPPORTED = {
    "hybrid_fsdp_expt_group": "HSDP of expert (MoE) parameters",
    "fsdp_group_ag": "a separate all-gather process group",
    "expt_fsdp_group_ag": "a separate expert all-gather process group",
    "keep_fp8_transpose_cache": "Transformer Engine's fp8 transpose cache",
    "nccl_ub": "NCCL user buffers",
    "fsdp_double_buffer": "double buffering",
    "fsdp_db_use_persist_buf_on_alloc_fail": "double buffering",
    "disable_symmetric_registration": "NCCL user-buffer registration",
    "enable_fine_grained_param_gather": "per-module parameter gathers inside a unit",
    "use_decoupled_grad": "gradients in Parameter.decoupled_grad",
    "cuda_graph_mode": "CUDA-graph-safe buffers",
    "maxpool_double_buffer": "double buffering",
}


def _strategy(name: str, value, allowed: Sequence[str]) -> str:
    # (True and False are ints to Python, not strategies.)
    if (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(STRATEGIES)
            and STRATEGIES[value] in allowed):
        return STRATEGIES[value]
    if isinstance(value, str) and value in allowed:
        return value
    choices = ", ".join(f"{STRATEGIES.index(a)} / {a!r}" for a in allowed)
    raise ValueError(f"{name}={value!r}: choose one of {choices}")


def _unit_classes(fsdp_unit_modules) -> frozenset:
    if fsdp_unit_modules is None:
        return frozenset()
    if isinstance(fsdp_unit_modules, (str, type)):
        raise TypeError(f"fsdp_unit_modules must be a sequence of classes or import paths, got {fsdp_unit_modules!r}")
    classes = set()
    for entry in fsdp_unit_modules:
        cls = entry
        if isinstance(entry, str):
            module_name, _, attr = entry.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), attr) if module_name else None
            except (ImportError, AttributeError):
                cls = None
            if cls is None:
                raise ValueError(f"fsdp_unit_modules: cannot import {entry!r} (a dotted path such as "
                                 "'torch.nn.TransformerEncoderLayer')")
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"fsdp_unit_modules: {entry!r} is not an nn.Module subclass")
        classes.add(cls)
    return frozenset(classes)


def _has_dim(device_mesh: DeviceMesh, name: str) -> bool:
    """`name` is one of the mesh's dimensions, or one flattened from them (DeviceMesh._flatten: NVIDIA's
    dp_shard_cp, the data- and context-parallel ranks FSDP shards over)."""
    if name in (device_mesh.mesh_dim_names or ()):
        return True
    try:
        device_mesh[name]
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def _check_mesh(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group) -> None:
    if device_mesh is None:
        given = [n for n, v in (("dp_outer_dim", dp_outer_dim), ("hybrid_fsdp_group", hybrid_fsdp_group)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} need a device_mesh (HSDP is a 2-D data-parallel mesh)")
        return
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch DeviceMesh, got {type(device_mesh).__name__}")
    names = device_mesh.mesh_dim_names or ()
    if dp_shard_dim is None:
        raise ValueError(f"device_mesh given: dp_shard_dim must name its sharding dimension (one of {names})")
    for arg, dim in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim), ("tp_dim", tp_dim)):
        if dim is not None and not _has_dim(device_mesh, dim):
            raise ValueError(f"{arg}={dim!r} is not a dimension of device_mesh (its dimensions: {names}, or one "
                             "flattened from them, as dp_shard_cp from dp_shard and cp)")
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        raise ValueError(f"dp_outer_dim={dp_outer_dim!r} and hybrid_fsdp_group={hybrid_fsdp_group!r} go together "
                         "(HSDP) or are both None")
    if hybrid_fsdp_group is not None:
        expected = device_mesh[dp_outer_dim].size() * device_mesh[dp_shard_dim].size()
        if dist.get_world_size(hybrid_fsdp_group) != expected:
            raise ValueError(f"hybrid_fsdp_group has {dist.get_world_size(hybrid_fsdp_group)} ranks; the "
                             f"{dp_outer_dim!r} x {dp_shard_dim!r} dimensions of device_mesh hold {expected}")


def _check_expert_mesh(expt_device_mesh, expert_units: tuple, dp_shard_dim, dp_outer_dim, strategy: str):
    """The expert mesh's data-parallel dimension (None without one): NVIDIA's rule, the dimension
    named dp_shard_dim, or "expt_dp" of parallel_state.get_expert_device_mesh()."""
    if expt_device_mesh is None:
        split = any(isinstance(p, DTensor) for unit in expert_units for p in unit.parameters())
        if expert_units and (split or (parallel_state.model_parallel_is_initialized()
                                       and not experts_share_dense_layout())):
            raise ValueError("fully_shard: the module's experts are laid out over other ranks than its dense "
                             "layers (expert parallelism, or an expert TP size other than the TP size): pass "
                             "expt_device_mesh (parallel_state.get_expert_device_mesh())")
        return None  # EP 1, expert TP = TP: the experts shard with the dense layers
    if not isinstance(expt_device_mesh, DeviceMesh):
        raise TypeError(f"expt_device_mesh must be a torch DeviceMesh, got {type(expt_device_mesh).__name__}")
    if not expert_units:
        raise ValueError("fully_shard: expt_device_mesh given, but the module has no expert parameters (a MoE "
                         "layer's experts, whose parameters are marked allreduce=False)")
    if dp_outer_dim is not None or strategy == "no_shard":
        raise NotImplementedError("fully_shard: expt_device_mesh with HSDP (dp_outer_dim) or zero_dp_strategy 0 / "
                                  "'no_shard' is not supported: experts shard over their own data-parallel ranks")
    names = expt_device_mesh.mesh_dim_names or ()
    for dim in (dp_shard_dim, "expt_dp"):
        if dim in names:
            return dim
    raise ValueError(f"expt_device_mesh has dimensions {names}: its data-parallel one must be named "
                     f"dp_shard_dim ({dp_shard_dim!r}) or 'expt_dp' (parallel_state.get_expert_device_mesh())")


def _check_no_shard_mesh(device_mesh: DeviceMesh, dp_shard_dim, dp_outer_dim, tp_dim) -> None:
    """no_shard replicates over every data-parallel rank of the mesh; tensor parallelism, if
    any, is its last dimension (FSDP2 then gets a (data-parallel, 1) mesh beside it)."""
    expected = tuple(name for name in (dp_outer_dim, dp_shard_dim, tp_dim) if name is not None)
    if device_mesh.mesh_dim_names != expected:
        raise ValueError(f"fully_shard: zero_dp_strategy 0 / 'no_shard' replicates over the data-parallel dimensions "
                         f"of device_mesh; its dimensions must be {expected} (dp_outer_dim, dp_shard_dim, tp_dim "
                         f"in this order), got {device_mesh.mesh_dim_names}")
    if device_mesh.size() != dist.get_world_size():
        raise NotImplementedError(f"fully_shard: zero_dp_strategy 0 / 'no_shard' on a device_mesh of "
                                  f"{device_mesh.size()} of the {dist.get_world_size()} ranks: give a mesh of "
                                  "every rank")


def _no_shard_mesh(device_type: str, device_mesh: Optional[DeviceMesh], tp_dim: Optional[str]) -> DeviceMesh:
    """A (dp_replicate, dp_shard of size 1) mesh of every data-parallel rank: FSDP2 replicates
    across the first dimension (HSDP with shards of one rank: DDP). With tensor parallelism it
    is cut from a (data-parallel, 1, tensor-parallel) mesh of the user's ranks in the user's
    order, which FSDP2 combines with the tensor-parallel parameters' own mesh."""
    if device_mesh is None or tp_dim is None:
        return init_device_mesh(device_type, (dist.get_world_size(), 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    ranks = device_mesh.mesh.reshape(-1, 1, device_mesh[tp_dim].size())
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("dp_replicate", "dp_shard", tp_dim))
    return mesh["dp_replicate", "dp_shard"]


def _compute_dtype(module: nn.Module) -> Optional[torch.dtype]:
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError(f"fully_shard: the module's floating-point parameters mix dtypes {sorted(map(str, dtypes))}; "
                         "build it in one dtype (its compute dtype)")
    return next(iter(dtypes), None)


@torch.no_grad()
def _materialize(module: nn.Module, mesh: DeviceMesh, group: dist.ProcessGroup, device: torch.device) -> None:
    """A meta-device model after sharding: allocate this rank's shards only, then initialize
    them. megatron_fsdp's layers draw as TorchFullyShardedDataParallel's meta path does (each rank
    its part, initialization.initialize_parameters: the same weights through either API, at any
    layout); every other submodule initializes its own parameters and buffers
    (`reset_parameters()`, or `_reset_parameters()` as torch's MultiheadAttention has). Replicas
    (HSDP) then take replica 0's values, and every rank rank 0's buffers."""
    module.to_empty(device=device)
    ours = False
    for sub in module.modules():
        if has_recorded_parameters(sub):
            ours = True
            continue
        reset = _torch_compat.parameter_initializer(sub)
        if reset is not None:
            reset()
    if ours:
        initialize_parameters(module, others_initialized=True)
    broadcast_fsdp_params(module, mesh, group)


def fully_shard_model(
    module: nn.Module,
    device_mesh: Optional[DeviceMesh] = None,
    dp_shard_dim: Optional[str] = None,
    dp_outer_dim: Optional[str] = None,
    tp_dim: Optional[str] = None,
    hybrid_fsdp_group: Optional[dist.ProcessGroup] = None,
    hybrid_fsdp_expt_group: Optional[dist.ProcessGroup] = None,
    expt_device_mesh: Optional[DeviceMesh] = None,
    fsdp_group_ag: Optional[dist.ProcessGroup] = None,
    expt_fsdp_group_ag: Optional[dist.ProcessGroup] = None,
    fsdp_unit_modules: Optional[Sequence[Type[nn.Module]] | Sequence[str]] = None,
    zero_dp_strategy: str | int = 3,
    outer_dp_sharding_strategy: str | int = 0,
    device: Optional[torch.device] = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False,
    use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False,
    maxpool_double_buffer: bool = False,
    *,
    cpu_offload: bool = False,
) -> MegatronFSDP:
    """Shard `module` with FSDP2: each outermost instance of a class in `fsdp_unit_modules` is
    a unit (gathered for its own forward and backward), sharded bottom-up, then the root.
    See the module's docstring for the strategies; the arguments are NVIDIA's. Honoured on
    FSDP2 as follows: overlap_* (FSDP2 always overlaps: False is refused), average_in_collective
    (either way gradients are the data-parallel mean), calculate_per_token_loss (gradients
    summed, not averaged), preproc_state_dict_for_dcp_ckpt (FSDP2's state dicts are DCP-ready
    DTensors either way), report_nan_in_param_grad (finish_grad_sync checks).

    `cpu_offload` (ours; NVIDIA's 0.6.1 has none): the sharded parameters and gradients live in
    CPU memory (pinned on CUDA; FSDP2's CPUOffloadPolicy), gathered to the device per unit, so
    the optimizer's state and step stay on the CPU."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard_model: module must be a torch.nn.Module, got {type(module).__name__}")
    local = dict(locals())
    for name, what in _UNSUPPORTED.items():
        if local[name] not in (None, False):
            raise NotImplementedError(f"fully_shard: {name}={local[name]!r} is not supported: FSDP2 has no "
                                      f"{what}; leave it at its default")
    for name in ("overlap_grad_reduce", "overlap_param_gather"):
        if local[name] is not True:
            raise ValueError(f"fully_shard: {name}={local[name]!r}: FSDP2 always overlaps communication with "
                             "compute; only True is supported")
    for name in ("init_model_with_meta_device", "sync_model_each_microbatch", "preproc_state_dict_for_dcp_ckpt",
                 "report_nan_in_param_grad", "average_in_collective", "disable_bucketing",
                 "calculate_per_token_loss", "cpu_offload"):
        if not isinstance(local[name], bool):
            raise TypeError(f"fully_shard: {name} must be True or False, got {local[name]!r}")
    if not isinstance(mixed_precision_policy, MixedPrecisionPolicy):
        raise TypeError("fully_shard: mixed_precision_policy must be a megatron_fsdp.MixedPrecisionPolicy, got "
                        f"{type(mixed_precision_policy).__name__}")
    strategy = _strategy("zero_dp_strategy", zero_dp_strategy, STRATEGIES)
    on_meta = any(p.device.type == "meta" for p in module.parameters())
    if init_model_with_meta_device and strategy == "no_shard":
        raise ValueError("fully_shard: init_model_with_meta_device=True shards the initialization; with "
                         "zero_dp_strategy 0 / 'no_shard' nothing is sharded: build the model on a device")
    if init_model_with_meta_device != on_meta:
        raise ValueError(f"fully_shard: init_model_with_meta_device={init_model_with_meta_device} but the module's "
                         f"parameters are {'on' if on_meta else 'not on'} the meta device: build it under "
                         "torch.device('meta') with True, on a device with False")
    unknown = unrecorded_parameters_of_layers(module) if init_model_with_meta_device else []
    if unknown:  # _materialize initializes megatron_fsdp's layers by their records alone
        raise ValueError(f"fully_shard: init_model_with_meta_device=True cannot initialize {', '.join(unknown[:5])}"
                         f"{' ...' if len(unknown) > 5 else ''}: megatron_fsdp layers that hold parameters of their "
                         "own; create those in a submodule with reset_parameters(), or build the model on a device")
    outer = _strategy("outer_dp_sharding_strategy", outer_dp_sharding_strategy, STRATEGIES[:2])
    if outer == "optim":
        if dp_outer_dim is None:
            raise ValueError("fully_shard: outer_dp_sharding_strategy 1 / 'optim' (HFSDP) shards the optimizer "
                             "state across dp_outer_dim: pass a device_mesh with dp_outer_dim and hybrid_fsdp_group")
        if strategy == "no_shard":
            raise ValueError("fully_shard: outer_dp_sharding_strategy 1 / 'optim' shards each inner shard again: "
                             "zero_dp_strategy 0 / 'no_shard' has none; use 1, 2 or 3")
        if cpu_offload:
            raise NotImplementedError("fully_shard: outer_dp_sharding_strategy 1 / 'optim' with cpu_offload=True is "
                                      "not supported: the outer reductions run on the device")
    unit_classes = _unit_classes(fsdp_unit_modules)
    expert_units = () if disable_bucketing else _expert_units(module)
    expert_dim = _check_expert_mesh(expt_device_mesh, expert_units, dp_shard_dim, dp_outer_dim, strategy)
    if not dist.is_initialized():
        raise RuntimeError("fully_shard: torch.distributed is not initialized (call init_process_group first)")
    _check_mesh(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group)
    device_type = backend_device_type(dist.get_backend())
    if strategy == "no_shard" and device_mesh is not None:
        _check_no_shard_mesh(device_mesh, dp_shard_dim, dp_outer_dim, tp_dim)
    if any(isinstance(p, DTensor) for p in module.parameters()) and (device_mesh is None or tp_dim is None):
        raise ValueError("fully_shard: the module holds DTensor (tensor-parallel) parameters: pass the device_mesh "
                         "they live on, with tp_dim and dp_shard_dim")
    compute_dtype = _compute_dtype(module)
    if device is not None and not on_meta:
        module.to(device)

    # Every check has passed on every rank alike: from here on, meshes and collectives.
    if strategy == "no_shard":
        mesh = _no_shard_mesh(device_type, device_mesh, tp_dim)
        group = mesh.get_group(0)
    elif device_mesh is None:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        group = mesh.get_group()
    elif dp_outer_dim is not None:
        mesh, group = device_mesh[dp_outer_dim, dp_shard_dim], hybrid_fsdp_group
    else:
        mesh = device_mesh[dp_shard_dim]
        group = mesh.get_group()
    # HFSDP: FSDP2 shards over the inner dimension only; the outer one is OuterShardedOptimizerState's.
    fsdp_mesh = device_mesh[dp_shard_dim] if outer == "optim" else mesh

    main_dtype = mixed_precision_policy.main_params_dtype
    cast = main_dtype is not None and compute_dtype is not None and main_dtype != compute_dtype
    reduce_dtype = mixed_precision_policy.grad_comm_dtype or (main_dtype if cast else None)
    plan = FSDPPlan(
        mesh=fsdp_mesh,
        process_group=group,
        mp_policy=_FSDP2Policy(param_dtype=compute_dtype if cast else None, reduce_dtype=reduce_dtype),
        reshard_after_forward=strategy == "optim_grads_params",
        wrap_classes=unit_classes,
        units=() if disable_bucketing else tuple(_units(module, unit_classes)),
        fp8_config=None,
        fp8_param_gather=False,
        force_sum_reduction=dist.get_backend(group) == "gloo",
        explicit_backward_prefetch=False,
        materialize_on=None,
        copy_kernels=False,
        main_params_dtype=main_dtype if cast else None,
        cpu_offload=cpu_offload,
        expert_units=expert_units if expert_dim else (),
        expert_mesh=expt_device_mesh[expert_dim] if expert_dim else None,
        # NOTE: the experts' gradients are divided as the dense ones are averaged: by the dense DP size.
        expert_grad_divide_factor=(1.0 if calculate_per_token_loss else float(mesh.size())) if expert_dim else None,
    )
    before = list(module.named_parameters())
    apply_fsdp_plan(module, plan)
    if on_meta:
        _materialize(module, mesh, group, torch.device(device) if device is not None else _materialization_device(mesh))
    outer_shards = None
    if outer == "optim":
        outer_shards = OuterShardedOptimizerState(
            list(module.parameters()), device_mesh, dp_outer_dim, device_mesh[dp_outer_dim].get_group(),
            mean=not calculate_per_token_loss, comm_dtype=mixed_precision_policy.grad_comm_dtype)
    for name, param in before:  # for fully_shard_optimizer: each parameter's sharded successor
        param._megatron_fsdp_sharded = module.get_parameter(name)
        param._megatron_fsdp_sharded._megatron_fsdp_outer = outer_shards
    if calculate_per_token_loss:
        for m in module.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
    return MegatronFSDP(module, mesh, group, zero_dp_strategy=strategy,
                        sync_model_each_microbatch=sync_model_each_microbatch,
                        report_nan_in_param_grad=report_nan_in_param_grad, outer_shards=outer_shards)


# Optimizers whose lazily created state is all zeros (step 0): created here as the first step
# would, so that DCP can load into `optimizer.state_dict()` before any step (NVIDIA's way).
_ZERO_STATE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@torch.no_grad()
def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """One step with zero gradients at learning rate 0 creates the state, which is then reset
    to what a first step finds (zeros, step 0): the parameters do not move (lr 0 scales every
    update, AdamW's decay included) and training is unchanged (tests/test_fully_shard.py)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0 if not torch.is_tensor(group["lr"]) else torch.zeros_like(group["lr"])
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p in params:
            p.grad = None
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                value.zero_()
            elif key == "step":
                state[key] = 0


def fully_shard_optimizer(optimizer: torch.optim.Optimizer,
                          preproc_state_dict_for_dcp_ckpt: bool = True) -> torch.optim.Optimizer:
    """Point `optimizer` (built on the module's parameters before fully_shard_model) at the
    sharded parameters, in place; returns it. The state of SGD, Adam and AdamW exists from
    here on (as it would after a first step, zeros), so that
    `dcp.load({"optimizer": optimizer.state_dict()}, ...)` restores a checkpoint into it;
    other optimizers create theirs in their first step (load theirs with
    torch.distributed.checkpoint.state_dict.set_optimizer_state_dict).

    HFSDP (outer_dp_sharding_strategy 'optim'): the optimizer steps this rank's pieces of the
    shards (distributed/outer_sharding.py). Its `state_dict()` is in the parameters' layout,
    a gathered copy: after `dcp.load` into it, `optimizer.load_state_dict` puts it back.
    torch's get/set_optimizer_state_dict, which map the optimizer's parameters to the model's
    names, do not apply."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard_optimizer: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not isinstance(preproc_state_dict_for_dcp_ckpt, bool):
        raise TypeError(f"fully_shard_optimizer: preproc_state_dict_for_dcp_ckpt must be True or False, got "
                        f"{preproc_state_dict_for_dcp_ckpt!r}")
    if optimizer.state:
        raise ValueError("fully_shard_optimizer: the optimizer has state already (it has stepped): build it "
                         "on the model's parameters and shard it before the first step")
    for group in optimizer.param_groups:
        replaced = []
        for p in group["params"]:
            if getattr(p, "_megatron_fsdp_sharded", None) is None and not isinstance(p, DTensor):
                raise ValueError("fully_shard_optimizer: the optimizer holds a parameter of shape "
                                 f"{tuple(p.shape)} that fully_shard_model did not shard")
            replaced.append(getattr(p, "_megatron_fsdp_sharded", p))
        group["params"] = replaced
    outers = {id(o): o for g in optimizer.param_groups for p in g["params"]
              if (o := getattr(p, "_megatron_fsdp_outer", None)) is not None}
    if len(outers) > 1:
        raise ValueError("fully_shard_optimizer: the optimizer holds the parameters of several HFSDP models; "
                         "build one optimizer per model")
    outer = next(iter(outers.values()), None)
    if outer is not None:  # HFSDP: the optimizer steps this rank's pieces of the shards
        outer.adopt(optimizer)
    if type(optimizer) in _ZERO_STATE_OPTIMIZERS:
        _create_state(optimizer)
    if outer is not None:
        outer.install_hooks()
    return optimizer


def fully_shard(module: nn.Module, optimizer: torch.optim.Optimizer, *args,
                **kwargs) -> tuple[MegatronFSDP, torch.optim.Optimizer]:
    """`fully_shard_model(module, *args, **kwargs)` (NVIDIA's arguments, in NVIDIA's order after
    `optimizer`) and `fully_shard_optimizer(optimizer)`: returns both."""
    bound = inspect.signature(fully_shard_model).bind(module, *args, **kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    own = {id(p) for p in module.parameters()}
    unknown = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if unknown:
        raise ValueError(f"fully_shard: the optimizer holds parameters that are not the module's (shapes {unknown[:3]})")
    if optimizer.state:
        raise ValueError("fully_shard: the optimizer has state already (it has stepped): build it on the model's "
                         "parameters and shard both before the first step")
    model = fully_shard_model(module, *args, **kwargs)
    optimizer = fully_shard_optimizer(
        optimizer, preproc_state_dict_for_dcp_ckpt=bound.arguments.get("preproc_state_dict_for_dcp_ckpt", True))
    return model, optimizer
