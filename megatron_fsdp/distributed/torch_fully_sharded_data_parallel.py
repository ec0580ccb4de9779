"""TorchFullyShardedDataParallel: Megatron-Core's FSDP2 wrapper, done fully.

The parallelism plan lives in one place, `__init__`: choose the data-parallel
mesh, the mixed-precision policy and the FSDP units, then `fully_shard` each
unit bottom-up and the root last. Tensor-parallel weights are DTensors on the
"tp" dimension of the same root mesh as the data-parallel mesh, so FSDP2
turns them into 2D (DP, TP) parameters.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .. import parallel_state
from ..initialization import initialize_parameters
from ..kernels.fsdp_copy_ops import disable_fsdp_copy_kernels, enable_fsdp_copy_kernels
from ..models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from ..models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from ..tensor_parallel.layers import ColumnParallelLinear
from ..tensor_parallel.utils import copy_tensor_model_parallel_attributes
from ..transformer.transformer_layer import TransformerLayer
from .data_parallel_base import _BaseDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig

DEFAULT_SUB_MODULES_TO_WRAP = frozenset({TransformerLayer, LanguageModelEmbedding, RotaryEmbedding,
                                         ColumnParallelLinear})


def _mesh_device_type(group: dist.ProcessGroup) -> str:
    return parallel_state._backend_device_type(dist.get_backend(group))


class TorchFullyShardedDataParallel(_BaseDataParallel):
    """Shards `module` with FSDP2 over the data-parallel group.

    - Units: every outermost submodule that is an instance of a class in
      `sub_modules_to_wrap` (plus classes listed in any submodule's
      `_fsdp_modules`) is its own unit, sharded bottom-up; the root module is
      the last unit. (Instances nested in a unit join it.) `disable_bucketing=True` makes the root the only unit: one
      all-gather and one reduce-scatter for the whole model per step.
    - A parameter used outside the unit that owns it (tied embedding and
      output weights) stays in the root unit, which is gathered for the whole
      forward and backward.
    - Mixed precision: with `config.bf16`/`config.fp16` the sharded master
      weights are fp32 and the gathered weights bf16/fp16; gradients are
      reduced in that dtype, or in fp32 with `ddp_config.grad_reduce_in_fp32`.
    - HSDP: with `ddp_config.num_distributed_optimizer_instances > 1` the
      parameters are replicated across instances and sharded within one.
    - Copy kernels: megatron_fsdp's C++ kernels serve FSDP2's copy-in and
      copy-out ops unless `ddp_config.fsdp_copy_kernels` is False.
    - Gradient accumulation: as in Megatron-Core, no_sync() changes nothing and
      every microbatch reduce-scatters into the sharded gradients, unless
      `ddp_config.accumulate_unsharded_grads_in_no_sync` trades a full
      unsharded gradient per rank for one reduce-scatter per step.
    - Meta device: a model built under `torch.device("meta")` (or with
      `config.init_model_with_meta_device`) is materialized shard by shard
      and initialized here, from the current generator state: seeded as
      before a normal build, it holds exactly the normally built weights.
    """

    def __init__(
        self,
        config,
        ddp_config: DistributedDataParallelConfig,
        module: nn.Module,
        sub_modules_to_wrap: Iterable[type] = DEFAULT_SUB_MODULES_TO_WRAP,
        disable_bucketing: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
    ):
        super().__init__(config=config, module=module)
        if not isinstance(ddp_config, DistributedDataParallelConfig):
            raise TypeError(f"ddp_config must be a DistributedDataParallelConfig, got {type(ddp_config).__name__}")
        if isinstance(module, FSDPModule):
            raise ValueError("module is already sharded with fully_shard")
        self.ddp_config = ddp_config
        self.reshard_after_forward = getattr(ddp_config, "reshard_after_forward", True)
        self.accumulate_unsharded_grads = getattr(ddp_config, "accumulate_unsharded_grads_in_no_sync", False)
        self.disable_bucketing = disable_bucketing
        self.sub_modules_to_wrap = self._wrap_classes(module, sub_modules_to_wrap)

        mesh = self._data_parallel_mesh(process_group)
        self._check_reshard_size(mesh)
        self.device_mesh = mesh
        self.process_group = (parallel_state.get_data_parallel_group(with_context_parallel=True)
                              if process_group is None else process_group)
        self.fsdp_units = self._units(module)  # validates: the last check before any change

        # fully_shard and to_empty make new Parameter objects, and float()
        # swaps a DTensor parameter's contents, attributes included: Megatron's
        # per-parameter attributes (tensor_model_parallel, ...) are restored
        # from this snapshot.
        originals = {name: SimpleNamespace() for name, _ in module.named_parameters()}
        for name, param in module.named_parameters():
            copy_tensor_model_parallel_attributes(originals[name], param)
        mp_policy = self._mixed_precision_policy(config, ddp_config)
        if mp_policy.param_dtype is not None:
            module.float()  # sharded master weights in fp32; FSDP gathers them in param_dtype
        if getattr(ddp_config, "fsdp_copy_kernels", True):
            enable_fsdp_copy_kernels()
        else:
            disable_fsdp_copy_kernels()
        on_meta = any(p.device.type == "meta" for p in module.parameters())
        for unit in self.fsdp_units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=mp_policy)
        # The root's parameters are needed again as soon as backward starts.
        root_reshard = False if self.reshard_after_forward is True else self.reshard_after_forward
        fully_shard(module, mesh=mesh, reshard_after_forward=root_reshard, mp_policy=mp_policy)
        if dist.get_backend(self.process_group) == "gloo":
            # gloo rejects ReduceOp.PREMUL_SUM, which FSDP2 reduces with once a
            # gradient divide factor other than the group size is set
            # (set_gradient_divide_factor); forcing SUM makes it divide after
            # the reduction instead. The setting belongs to each fully_shard
            # call's parameter group, so every unit needs it, not the root alone.
            for fsdp_module in module.modules():
                if isinstance(fsdp_module, FSDPModule):
                    fsdp_module.set_force_sum_reduction_for_comms(True)
        if getattr(config, "recompute_granularity", None) is not None:
            # Recomputation re-runs forwards inside backward and confuses FSDP's
            # implicit prefetch order; prefetch the previous unit explicitly.
            for previous, unit in zip(self.fsdp_units_in_forward_order, self.fsdp_units_in_forward_order[1:]):
                unit.set_modules_to_backward_prefetch([previous])
        if on_meta:
            # Materialize only the shards, then draw the values a normal build would.
            module.to_empty(device=parallel_state.get_device() if process_group is None
                            else torch.device(_mesh_device_type(process_group)))
            initialize_parameters(module)
        for name, param in module.named_parameters():
            copy_tensor_model_parallel_attributes(param, originals[name])
        self._in_no_sync = False
        self._unsynced_backward = False

    # ------------------------------------------------------------ the plan

    @staticmethod
    def _wrap_classes(module: nn.Module, sub_modules_to_wrap: Iterable[type]) -> frozenset:
        classes = set(sub_modules_to_wrap)
        for sub in module.modules():
            classes.update(getattr(sub, "_fsdp_modules", ()))
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(f"sub_modules_to_wrap must hold nn.Module subclasses, got {cls!r}")
        return frozenset(classes)

    def _data_parallel_mesh(self, process_group: Optional[dist.ProcessGroup]) -> DeviceMesh:
        instances = self.ddp_config.num_distributed_optimizer_instances
        if process_group is not None:
            if instances > 1:
                raise ValueError("process_group cannot be combined with num_distributed_optimizer_instances > 1")
            if parallel_state.model_parallel_is_initialized():
                for with_cp in (True, False):
                    if process_group is parallel_state.get_data_parallel_group(with_context_parallel=with_cp):
                        return parallel_state.get_data_parallel_mesh(with_context_parallel=with_cp)
            if any(isinstance(p, DTensor) and p.device_mesh.size() > 1 for p in self.module.parameters()):
                raise ValueError(
                    "a process_group other than parallel_state's data-parallel group cannot be combined "
                    "with tensor parallelism: the FSDP mesh must share its root with the TP mesh"
                )
            return DeviceMesh.from_group(process_group, _mesh_device_type(process_group))
        if instances != parallel_state.get_num_distributed_optimizer_instances():
            raise ValueError(
                f"ddp_config.num_distributed_optimizer_instances ({instances}) differs from "
                f"parallel_state's ({parallel_state.get_num_distributed_optimizer_instances()}); pass the "
                "same value to initialize_model_parallel"
            )
        if instances > 1:
            return parallel_state.get_hybrid_data_parallel_mesh()
        return parallel_state.get_data_parallel_mesh(with_context_parallel=True)

    def _check_reshard_size(self, mesh: DeviceMesh) -> None:
        r = self.reshard_after_forward
        if isinstance(r, bool):
            return
        if any(isinstance(p, DTensor) for p in self.module.parameters()):
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

    @staticmethod
    def _mixed_precision_policy(config, ddp_config) -> MixedPrecisionPolicy:
        if getattr(config, "bf16", False):
            param_dtype = torch.bfloat16
        elif getattr(config, "fp16", False):
            param_dtype = torch.float16
        else:
            param_dtype = None
        reduce_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else param_dtype
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def _units(self, root: nn.Module) -> list[nn.Module]:
        """The submodules to shard, descendants before ancestors.

        An instance of a wrap class nested inside another one joins the outer
        unit: a unit's parameters are freed when its forward returns, so the
        bias a Megatron linear returns with skip_bias_add (a view of its
        parameter) must not outlive its unit.
        """
        if self.disable_bucketing:
            self.fsdp_units_in_forward_order = []
            return []
        kept_in_root = self._modules_owning_shared_params(root)
        wrap = tuple(self.sub_modules_to_wrap)
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
        self.fsdp_units_in_forward_order = units
        return list(reversed(units))

    @staticmethod
    def _modules_owning_shared_params(root: nn.Module) -> set[nn.Module]:
        """Modules (and their ancestors) owning a parameter that another part
        of the model uses in forward, such as a tied embedding weight."""
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

    # ------------------------------------------------------------ Megatron's interface

    def forward(self, *inputs, **kwargs):
        if not self._in_no_sync and torch.is_grad_enabled():
            self._unsynced_backward = False  # this step's backward reduces what accumulated
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """By default a no-op, as in Megatron-Core: each backward inside still
        reduce-scatters, and gradients accumulate sharded. With
        `accumulate_unsharded_grads_in_no_sync`, backward passes inside keep
        unsharded gradients without any reduce-scatter, and the first backward
        outside reduces everything."""
        if not self.accumulate_unsharded_grads:
            yield
            return
        self.module.set_requires_gradient_sync(False)
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False
            self._unsynced_backward = True
            self.module.set_requires_gradient_sync(True)

    def zero_grad_buffer(self) -> None:
        """Drop every gradient, including the unsharded ones FSDP2 accumulates
        inside no_sync(): an accumulation abandoned part-way must not leak
        into the next step."""
        super().zero_grad_buffer()
        for fsdp_param in self._fsdp_params():
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
        self._unsynced_backward = False

    def unsharded_grad_bytes(self) -> int:
        """Bytes this rank holds in unsharded gradients awaiting a
        reduce-scatter: zero between microbatches unless
        `accumulate_unsharded_grads_in_no_sync` is on."""
        held = 0
        for fsdp_param in self._fsdp_params():
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            # fp32 training accumulates in the unsharded parameter's .grad;
            # mixed precision upcasts into unsharded_accumulated_grad.
            for grad in (fsdp_param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad):
                if grad is not None:
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    held += local.numel() * local.element_size()
        return held

    def _fsdp_params(self):
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                for group in module._get_fsdp_state()._fsdp_param_groups:
                    yield from group.fsdp_params

    def start_grad_sync(self, *unused) -> None:
        """No-op: FSDP2 launches each unit's reduce-scatter during backward."""

    def finish_grad_sync(self) -> None:
        """Reduce-scatters are waited for at the end of backward; this checks
        that the last backward did synchronize (only the opt-in unsharded
        accumulation can skip it), and applies check_for_nan_in_grad."""
        if self._unsynced_backward:
            raise RuntimeError(
                "gradients are not synchronized: every backward ran inside no_sync(). Run the last "
                "microbatch's forward and backward outside no_sync(), as Megatron's schedules do"
            )
        if self.ddp_config.check_for_nan_in_grad:
            self._check_grads_finite()

    def _check_grads_finite(self) -> None:
        # Each rank holds different shards: agree on the verdict so that every
        # rank raises, not only the one holding the bad shard.
        bad = [name for name, p in self.module.named_parameters() if p.grad is not None
               and not torch.isfinite(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).all()]
        flag = torch.tensor([1.0 if bad else 0.0], device=parallel_state.get_device()
                            if parallel_state.model_parallel_is_initialized() else None)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            where = f"this rank's shards of {bad[:5]}" if bad else "shards held by other ranks"
            raise RuntimeError(f"rank {dist.get_rank()}: non-finite gradient (NaN or Inf) in {where}")

    def broadcast_params(self) -> None:
        """Each shard has one owner per replica: broadcast shards across HSDP
        replicas, and buffers across all data-parallel ranks."""
        with torch.no_grad():
            if self.device_mesh.ndim == 2:
                replicate = self.device_mesh.get_group(0)
                src = dist.get_global_rank(replicate, 0)
                for p in self.module.parameters():
                    dist.broadcast(p.to_local(), src=src, group=replicate)
            src = dist.get_global_rank(self.process_group, 0)
            for b in self.module.buffers():
                dist.broadcast(b, src=src, group=self.process_group)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the sharded parameters in place: values may be DTensors
        sharded like the model's, or full tensors (each rank keeps its shard)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = not any(isinstance(v, DTensor) for v in state_dict.values())
        # A copy: torch replaces full tensors in the dict it is given by their shards.
        return set_model_state_dict(self.module, dict(state_dict),
                                    options=StateDictOptions(full_state_dict=full, strict=strict))
