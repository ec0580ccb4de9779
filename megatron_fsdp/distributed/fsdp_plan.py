"""How TorchFullyShardedDataParallel parallelizes a model, step by step.

    plan = plan_fsdp(config, ddp_config, module, ...)  # every check, on every rank;
                                                       # nothing changes, nothing communicates
    apply_fsdp_plan(module, plan):
        cast_main_weights             mixed precision keeps fp32 shards, gathers bf16/fp16
        convert_fp8                   config.fp8: the fp8 converter (fp8/convert.py); with
                                      fp8_param_gather the linear weights gather as fp8
        compile_layers                torch_compile: each TransformerLayer unit compiled
        shard_units                   fully_shard each unit bottom-up, then the root
        materialize_meta_parameters   a meta-device model gets its shards and initial values
        compute_fp8_scales            the fp8 weights' first scales (collective)
        install_copy_kernels          fsdp_copy_kernels: our kernels serve FSDP2's copy ops
        restore_tp_attributes         Megatron's per-parameter TP attributes

Tensor-parallel weights are DTensors on the "tp" dimension of the same root
mesh as the data-parallel mesh, so `fully_shard` turns them into 2D (DP, TP)
parameters.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from .. import parallel_state
from .._process_groups import backend_device_type
from ..fp8_utils import check_fp8_param_gather
from ..initialization import initialize_parameters
from ..tensor_parallel.utils import copy_tensor_model_parallel_attributes
from .distributed_data_parallel_config import DistributedDataParallelConfig


@dataclasses.dataclass(frozen=True)
class FSDPPlan:
    """What apply_fsdp_plan does to the model, decided before it starts."""

    mesh: DeviceMesh  # 1D data-parallel, or 2D (replicate, shard) for HSDP
    process_group: dist.ProcessGroup  # all data-parallel ranks (with context parallelism)
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int
    wrap_classes: frozenset  # sub_modules_to_wrap plus every `_fsdp_modules` entry
    units: tuple  # the unit modules in forward order; the root is the last unit, not listed
    fp8_config: Optional[object]  # the config whose fp8 settings the converter applies (None: no fp8)
    fp8_param_gather: bool
    force_sum_reduction: bool  # gloo: reduce with SUM, then divide
    explicit_backward_prefetch: bool  # activation recomputation confuses the implicit order
    materialize_on: Optional[torch.device]  # the model is on the meta device: materialize here
    copy_kernels: bool  # install megatron_fsdp's kernels behind FSDP2's copy ops (process-wide)
    compiled: tuple = ()  # the units torch_compile compiles (TransformerLayers), in forward order
    # The dtype of the sharded (main) weights the optimizer updates; None: the model's own.
    main_params_dtype: Optional[torch.dtype] = None
    # Sharded parameters and gradients in (pinned, on CUDA) CPU memory, so the optimizer steps there.
    cpu_offload: bool = False
    # Mixture of experts: the experts modules (parameters marked allreduce=False, Megatron's marker),
    # each a unit of its own sharded over the expert-data-parallel mesh (world / (EP x expert TP)),
    # inside its layer's unit; their gradients divided by the dense data x context-parallel size.
    expert_units: tuple = ()
    expert_mesh: Optional[DeviceMesh] = None
    expert_grad_divide_factor: Optional[float] = None


def plan_fsdp(config, ddp_config, module: nn.Module, sub_modules_to_wrap: Iterable[type],
              disable_bucketing: bool, process_group: Optional[dist.ProcessGroup]) -> FSDPPlan:
    """Validate every argument and decide the plan. Changes nothing and
    communicates nothing, so bad input raises on every rank alike."""
    if not isinstance(ddp_config, DistributedDataParallelConfig):
        raise TypeError(f"ddp_config must be a DistributedDataParallelConfig, got {type(ddp_config).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError("module is already sharded with fully_shard")
    reshard_after_forward = getattr(ddp_config, "reshard_after_forward", True)
    wrap_classes = _wrap_classes(module, sub_modules_to_wrap)
    mesh = _data_parallel_mesh(ddp_config, module, process_group)
    _check_reshard_size(module, mesh, reshard_after_forward)
    check_fp8_param_gather(config, ddp_config, reshard_after_forward)
    if getattr(config, "fp8", None) is not None:
        _fp8().linears_to_convert(module, config)  # fp8's GEMM shape rule, before anything changes
    units = () if disable_bucketing else _units(module, wrap_classes)
    compiled = _layers_to_compile(ddp_config, module, units)
    if process_group is None:
        process_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    on_meta = any(p.device.type == "meta" for p in module.parameters())
    mp_policy = _mixed_precision_policy(config, ddp_config)
    expert_units = _expert_units(module)
    _check_experts(expert_units, ddp_config, mesh, reshard_after_forward, disable_bucketing)
    expert_units = () if disable_bucketing else expert_units
    return FSDPPlan(
        mesh=mesh,
        process_group=process_group,
        mp_policy=mp_policy,
        reshard_after_forward=reshard_after_forward,
        wrap_classes=wrap_classes,
        units=tuple(units),
        fp8_config=config if getattr(config, "fp8", None) is not None else None,
        fp8_param_gather=ddp_config.fp8_param_gather,
        force_sum_reduction=dist.get_backend(process_group) == "gloo",
        explicit_backward_prefetch=getattr(config, "recompute_granularity", None) is not None,
        materialize_on=_materialization_device(mesh) if on_meta else None,
        copy_kernels=getattr(ddp_config, "fsdp_copy_kernels", False),
        compiled=compiled,
        main_params_dtype=torch.float32 if mp_policy.param_dtype is not None else None,
        cpu_offload=getattr(ddp_config, "cpu_offload", False),
        expert_units=expert_units,
        expert_mesh=parallel_state.get_expert_data_parallel_mesh() if expert_units else None,
        expert_grad_divide_factor=(float(parallel_state.get_data_parallel_world_size(with_context_parallel=True))
                                   if expert_units else None),
    )


def apply_fsdp_plan(module: nn.Module, plan: FSDPPlan) -> None:
    """The changes, in order; `module` ends up an FSDPModule."""
    tp_attributes = snapshot_tp_attributes(module)
    cast_main_weights(module, plan)
    convert_fp8(module, plan)
    compile_layers(plan)
    shard_units(module, plan)
    materialize_meta_parameters(module, plan, tp_attributes)
    compute_fp8_scales(module, plan)
    install_copy_kernels(plan)
    restore_tp_attributes(module, tp_attributes)


# ---------------------------------------------------------------- the steps


def _fp8():
    """megatron_fsdp.fp8, imported by the plans that run fp8 only: its linears, weight subclass and
    kernels (and torch's compiler, which they load) stay out of every other job's start-up."""
    from .. import fp8

    return fp8


def snapshot_tp_attributes(module: nn.Module) -> dict[str, SimpleNamespace]:
    """fully_shard, fp8 conversion and to_empty make new Parameter objects,
    and float() swaps a DTensor parameter's contents, attributes included:
    Megatron's per-parameter attributes (tensor_model_parallel, ...) are kept
    aside by parameter name."""
    saved = {}
    for name, param in module.named_parameters():
        saved[name] = SimpleNamespace()
        copy_tensor_model_parallel_attributes(saved[name], param)
        if hasattr(param, "allreduce"):  # Megatron's expert marker (False)
            saved[name].allreduce = param.allreduce
    return saved


def cast_main_weights(module: nn.Module, plan: FSDPPlan) -> None:
    """The sharded weights are the optimizer's main weights, in their own dtype (fp32 under
    bf16/fp16); FSDP gathers them in the policy's param_dtype."""
    if plan.main_params_dtype is not None:
        module.to(plan.main_params_dtype)


def convert_fp8(module: nn.Module, plan: FSDPPlan) -> None:
    """Before fully_shard: the fp8 converter, then (fp8_param_gather) the fp8
    weight subclass, so that FSDP2 shards it and calls its all-gather hooks.
    Delayed scaling's state is created on the training device now, not in
    the first forward, which a compiled layer traces."""
    if plan.fp8_config is not None:
        _fp8().convert_to_fp8(module, plan.fp8_config)
        _fp8().materialize_fp8_state(module, _materialization_device(plan.mesh))
    if plan.fp8_param_gather:
        _fp8().convert_to_fp8_weights(module)


def compile_layers(plan: FSDPPlan) -> None:
    """Before fully_shard (after the fp8 conversion, which the graphs then include): FSDP2's
    hooks run around each compiled layer, its collectives outside the graph."""
    for layer in plan.compiled:
        layer.compile()


def shard_units(module: nn.Module, plan: FSDPPlan) -> None:
    """fully_shard each unit, descendants before ancestors, then the root."""
    offload = (CPUOffloadPolicy(pin_memory=plan.mesh.device_type == "cuda") if plan.cpu_offload
               else OffloadPolicy())
    for experts in plan.expert_units:  # inside their layers' units: sharded first
        fully_shard(experts, mesh=plan.expert_mesh, reshard_after_forward=plan.reshard_after_forward,
                    mp_policy=plan.mp_policy, offload_policy=offload, shard_placement_fn=_expert_shard_placement)
        _divide_expert_grads(experts, plan)
    for unit in reversed(plan.units):
        fully_shard(unit, mesh=plan.mesh, reshard_after_forward=plan.reshard_after_forward,
                    mp_policy=plan.mp_policy, offload_policy=offload)
    # The root's parameters are needed again as soon as backward starts.
    root_reshard = False if plan.reshard_after_forward is True else plan.reshard_after_forward
    fully_shard(module, mesh=plan.mesh, reshard_after_forward=root_reshard, mp_policy=plan.mp_policy,
                offload_policy=offload)
    if plan.force_sum_reduction:
        # gloo rejects ReduceOp.PREMUL_SUM, which FSDP2 reduces with once a
        # gradient divide factor other than the group size is set
        # (set_gradient_divide_factor); forcing SUM makes it divide after the
        # reduction instead. The setting belongs to each fully_shard call's
        # parameter group, so every unit needs it, not the root alone.
        for fsdp_module in module.modules():
            if isinstance(fsdp_module, FSDPModule):
                fsdp_module.set_force_sum_reduction_for_comms(True)
    if plan.explicit_backward_prefetch:
        # Recomputation re-runs forwards inside backward and confuses FSDP's
        # implicit prefetch order; prefetch the previous unit explicitly.
        for previous, unit in zip(plan.units, plan.units[1:]):
            unit.set_modules_to_backward_prefetch([previous])


def _divide_expert_grads(experts: FSDPModule, plan: FSDPPlan) -> None:
    """An expert's gradient sums the contributions of the tokens of every rank routed to it; the
    dense gradients are averaged over DP x CP, so the experts' are divided by that size too, not by
    their own mesh's (world / (EP x expert TP))."""
    if plan.expert_mesh.size() > 1:
        experts.set_gradient_divide_factor(plan.expert_grad_divide_factor)
        return
    # NOTE: a mesh of one rank reduces nothing, and FSDP2 (torch 2.13) then divides twice by a
    # set factor under force_sum_reduction_for_comms (gloo): the division is done here instead,
    # after its (identity) reduce-scatter.
    factor = plan.expert_grad_divide_factor
    experts.set_all_reduce_hook(lambda reduced: reduced.div_(factor))


def materialize_meta_parameters(module: nn.Module, plan: FSDPPlan, tp_attributes: dict) -> None:
    """Allocate only this rank's shards, then let each rank draw only its part
    (initialization.initialize_parameters, seeded from the current generator
    state): the same full weights at every TP, FSDP and HSDP layout, and through
    NVIDIA's fully_shard API, though not those an eager build draws. The
    initialization reads the TP attributes (a partition_stride's rows):
    restored first."""
    if plan.materialize_on is None:
        return
    module.to_empty(device=plan.materialize_on)
    restore_tp_attributes(module, tp_attributes)
    initialize_parameters(module)


def compute_fp8_scales(module: nn.Module, plan: FSDPPlan) -> None:
    """The first all-gather needs each fp8 weight's scale, computed from its
    values: only now are they final (the delayed-scaling histories have recorded
    nothing yet: they are left alone). Later the optimizer refreshes them."""
    if plan.fp8_param_gather:
        _fp8().refresh_fp8_weight_scales(module)


def install_copy_kernels(plan: FSDPPlan) -> None:
    """Only when asked: the op registry is process-wide, so this reaches every
    fully_shard module of the process (kernels/fsdp_copy_ops.py, the one adapter,
    installs and removes them). Imported here so that a run that never asks
    does not load the adapter."""
    if plan.copy_kernels:
        from ..kernels.fsdp_copy_ops import enable_fsdp_copy_kernels

        enable_fsdp_copy_kernels()


def restore_tp_attributes(module: nn.Module, saved: dict[str, SimpleNamespace]) -> None:
    for name, param in module.named_parameters():
        copy_tensor_model_parallel_attributes(param, saved[name])
        if hasattr(saved[name], "allreduce"):
            param.allreduce = saved[name].allreduce


# ---------------------------------------------------------------- planning helpers


def _wrap_classes(module: nn.Module, sub_modules_to_wrap: Iterable[type]) -> frozenset:
    classes = set(sub_modules_to_wrap)
    for sub in module.modules():
        classes.update(getattr(sub, "_fsdp_modules", ()))
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"sub_modules_to_wrap must hold nn.Module subclasses, got {cls!r}")
    return frozenset(classes)


def _data_parallel_mesh(ddp_config, module: nn.Module, process_group: Optional[dist.ProcessGroup]) -> DeviceMesh:
    instances = ddp_config.num_distributed_optimizer_instances
    if process_group is not None:
        if instances > 1:
            raise ValueError("process_group cannot be combined with num_distributed_optimizer_instances > 1")
        if parallel_state.model_parallel_is_initialized():
            for with_cp in (True, False):
                if process_group is parallel_state.get_data_parallel_group(with_context_parallel=with_cp):
                    return parallel_state.get_data_parallel_mesh(with_context_parallel=with_cp)
        if any(isinstance(p, DTensor) and p.device_mesh.size() > 1 for p in module.parameters()):
            raise ValueError(
                "a process_group other than parallel_state's data-parallel group cannot be combined "
                "with tensor parallelism: the FSDP mesh must share its root with the TP mesh"
            )
        return DeviceMesh.from_group(process_group, backend_device_type(dist.get_backend(process_group)))
    if instances != parallel_state.get_num_distributed_optimizer_instances():
        raise ValueError(
            f"ddp_config.num_distributed_optimizer_instances ({instances}) differs from "
            f"parallel_state's ({parallel_state.get_num_distributed_optimizer_instances()}); pass the "
            "same value to initialize_model_parallel"
        )
    if instances > 1:
        return parallel_state.get_hybrid_data_parallel_mesh()
    return parallel_state.get_data_parallel_mesh(with_context_parallel=True)


def _is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "allreduce", True) is False


def _expert_units(root: nn.Module) -> tuple:
    """The outermost modules whose parameters are all expert parameters (a MoE layer's experts)."""
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            params = list(child.parameters())
            if params and all(_is_expert(p) for p in params):
                units.append(child)
            else:
                visit(child)

    visit(root)
    return tuple(units)


def _check_experts(expert_units: tuple, ddp_config, mesh: DeviceMesh, reshard_after_forward,
                   disable_bucketing: bool) -> None:
    if not expert_units:
        return
    if disable_bucketing and not experts_share_dense_layout():
        raise NotImplementedError("disable_bucketing=True with expert parallelism (or an expert TP size other than "
                                  "the TP size): the experts need FSDP units of their own, on their own mesh")
    dense_mesh = parallel_state.get_data_parallel_mesh(with_context_parallel=True)
    if mesh is not dense_mesh or ddp_config.num_distributed_optimizer_instances > 1:
        raise NotImplementedError("a model with experts shards its dense parameters over parallel_state's data- "
                                  "and context-parallel group and its experts over the expert-data-parallel group: "
                                  "a process_group or HSDP (num_distributed_optimizer_instances > 1) is not supported")
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(f"reshard_after_forward={reshard_after_forward} with experts: use True or False")


def experts_share_dense_layout() -> bool:
    """EP 1 and expert TP = TP: the experts' data-parallel ranks are the dense layers' DP x CP ranks,
    so experts may shard (and average their gradients) with the dense parameters."""
    return (parallel_state.get_expert_model_parallel_world_size() == 1
            and parallel_state.get_expert_tensor_parallel_world_size()
            == parallel_state.get_tensor_model_parallel_world_size())


def _expert_shard_placement(param: torch.Tensor) -> Shard:
    """FSDP shards an expert weight along its largest dimension that expert and expert-tensor
    parallelism leave whole (the hidden size): dim 0 holds few experts per rank."""
    split = {p.dim for p in param.placements if isinstance(p, Shard)} if isinstance(param, DTensor) else {0}
    free = [d for d in range(param.dim()) if d not in split] or list(range(param.dim()))
    return Shard(max(free, key=lambda d: (param.size(d), -d)))


def _layers_to_compile(ddp_config, module: nn.Module, units) -> tuple:
    if not getattr(ddp_config, "torch_compile", False):
        return ()
    from ..transformer.transformer_layer import TransformerLayer

    layers = tuple(u for u in units if isinstance(u, TransformerLayer))
    if not layers:
        raise ValueError(f"torch_compile=True compiles each TransformerLayer unit, and {type(module).__name__} "
                         "has none (or disable_bucketing=True made the whole model one unit)")
    return layers


def _check_reshard_size(module: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool | int) -> None:
    r = reshard_after_forward
    if isinstance(r, bool):
        return
    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise NotImplementedError(
            f"reshard_after_forward={r}: torch FSDP2 cannot reshard tensor-parallel (DTensor) "
            "parameters to a smaller mesh; use True or False with tensor parallelism"
        )
    shard_size = mesh.size(mesh.ndim - 1)
    if shard_size % r != 0 or r >= shard_size:
        raise ValueError(
            f"reshard_after_forward={r} must be a divisor of the data-parallel shard size "
            f"({shard_size}) smaller than it"
        )


def _mixed_precision_policy(config, ddp_config) -> MixedPrecisionPolicy:
    if getattr(config, "bf16", False):
        param_dtype = torch.bfloat16
    elif getattr(config, "fp16", False):
        param_dtype = torch.float16
    else:
        param_dtype = None
    reduce_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else param_dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _materialization_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _units(root: nn.Module, wrap_classes: frozenset) -> list[nn.Module]:
    """The outermost instances of the wrap classes, in forward (module) order.

    An instance nested inside another one joins the outer unit: a unit's
    parameters are freed when its forward returns, so the bias a Megatron
    linear returns with skip_bias_add (a view of its parameter) must not
    outlive its unit.
    """
    kept_in_root = _modules_owning_shared_params(root)
    wrap = tuple(wrap_classes)
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, wrap) and child not in kept_in_root:
                if getattr(child, "skip_bias_add", False) and getattr(child, "bias", None) is not None:
                    raise ValueError(
                        f"{type(child).__name__} returns its bias (skip_bias_add=True), so it cannot be "
                        "an FSDP unit of its own: wrap the module that consumes the bias instead"
                    )
                units.append(child)
            else:
                visit(child)

    visit(root)
    return units


def _modules_owning_shared_params(root: nn.Module) -> set[nn.Module]:
    """Modules (and their ancestors) owning a parameter that another part of
    the model uses in forward, such as a tied embedding weight: it stays in
    the root unit, which is gathered for the whole forward and backward."""
    shared = getattr(root, "shared_embedding_or_output_weight", None)
    if shared is None or not getattr(root, "share_embeddings_and_output_weights", False):
        return set()
    weight = shared()
    owners: set[nn.Module] = set()

    def visit(m: nn.Module, path: list[nn.Module]) -> None:
        if any(p is weight for p in m.parameters(recurse=False)):
            owners.update(path + [m])
        for child in m.children():
            visit(child, path + [m])

    visit(root, [])
    return owners
