"""TorchFullyShardedDataParallel: Megatron-Core's FSDP2 wrapper, done fully.

The constructor is the plan of fsdp_plan.py: validate and decide
(`plan_fsdp`), then apply it (`apply_fsdp_plan`). This class adds
Megatron's data-parallel interface on top.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .. import _torch_compat, parallel_state, tensor_parallel
from ..models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from ..models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from ..transformer.transformer_layer import TransformerLayer
from ..utils import non_finite_ranks, weights_changed_hooks
from .data_parallel_base import _BaseDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig
from .fsdp_plan import apply_fsdp_plan, plan_fsdp

# Megatron-Core's default units, named in the signature as Megatron-Core does (the
# data-parallel package sits above the model packages; none of them imports it).
DEFAULT_SUB_MODULES_TO_WRAP = frozenset(
    {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding, tensor_parallel.ColumnParallelLinear})


def _copy_kernels_installed() -> bool:
    from ..kernels.fsdp_copy_ops import fsdp_copy_kernels_enabled

    return fsdp_copy_kernels_enabled()


def drop_unsharded_grads(module: nn.Module) -> None:
    """Drop the unsharded gradients FSDP2 accumulates while gradient sync is off."""
    for fsdp_param in _torch_compat.fsdp_params(module):
        _torch_compat.drop_unsharded_grads(fsdp_param)


def broadcast_fsdp_params(module: nn.Module, mesh, group: dist.ProcessGroup) -> None:
    """Rank 0's values everywhere: each shard across the replicas of a 2-D (replicate,
    shard) mesh (on a 1-D mesh each shard has one owner), buffers across `group` (every
    data-parallel rank); then the hooks of state derived from the weights (fp8 scales)."""
    with torch.no_grad():
        if mesh.ndim == 2:
            replicate = mesh.get_group(0)
            src = dist.get_global_rank(replicate, 0)
            for p in module.parameters():
                dist.broadcast(p.to_local(), src=src, group=replicate)
        src = dist.get_global_rank(group, 0)
        for b in module.buffers():
            dist.broadcast(b, src=src, group=group)
    for hook in weights_changed_hooks(module):
        hook()


def raise_on_bad_grads(module: nn.Module, *, device: torch.device, group: Optional[dist.ProcessGroup] = None,
                       nan_only: bool = False) -> None:
    """Raise on every rank of `group` when any rank's gradient shards hold a NaN or an Inf
    (`nan_only`: a NaN). Each rank holds different shards, so the ranks agree on the verdict
    first: one fused check and one all-reduce; the names are looked up only when something is
    wrong."""
    named = [(name, p.grad) for name, p in module.named_parameters() if p.grad is not None]
    _, bad_ranks = non_finite_ranks(grads=[g for _, g in named], device=device, group=group, nan_only=nan_only)
    if bad_ranks:
        def bad(g):
            local = g.to_local() if isinstance(g, DTensor) else g
            return bool(torch.isnan(local).any()) if nan_only else not bool(torch.isfinite(local).all())

        names = [name for name, g in named if bad(g)]
        where = f"this rank's shards of {names[:5]}" if names else "shards held by other ranks"
        what = "NaN in the gradient of" if nan_only else "non-finite gradient (NaN or Inf) in"
        raise RuntimeError(f"rank {dist.get_rank()}: {what} {where}")


def load_fsdp_state_dict(module: nn.Module, state_dict, strict: bool = True):
    """Load into a fully_shard module's parameters in place: DTensors sharded like them, or full
    tensors (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = not any(isinstance(v, DTensor) for v in state_dict.values())
    # A copy: torch replaces full tensors in the dict it is given by their shards.
    return set_model_state_dict(module, dict(state_dict), options=StateDictOptions(full_state_dict=full, strict=strict))


class TorchFullyShardedDataParallel(_BaseDataParallel):
    """Shards `module` with FSDP2 over the data-parallel group.

    - Units: every outermost submodule that is an instance of a class in
      `sub_modules_to_wrap` (plus classes listed in any submodule's
      `_fsdp_modules`) is its own unit, sharded bottom-up; the root module is
      the last unit. (Instances nested in a unit join it.) The default set is
      Megatron-Core's: TransformerLayer, LanguageModelEmbedding, RotaryEmbedding
      and ColumnParallelLinear (the output layer); a model adds its own unit
      classes with a `_fsdp_modules` list, as in Megatron-Core. `disable_bucketing=True` makes the root the only
      unit: one all-gather and one reduce-scatter for the whole model per step.
    - A parameter used outside the unit that owns it (tied embedding and
      output weights) stays in the root unit, which is gathered for the whole
      forward and backward.
    - Mixed precision: with `config.bf16`/`config.fp16` the sharded master
      weights are fp32 and the gathered weights bf16/fp16; gradients are
      reduced in that dtype, or in fp32 with `ddp_config.grad_reduce_in_fp32`.
    - fp8: with `ddp_config.fp8_param_gather` (and `config.fp8`) the linear
      weights are gathered as fp8 (megatron_fsdp.fp8).
    - HSDP: with `ddp_config.num_distributed_optimizer_instances > 1` the
      parameters are replicated across instances and sharded within one.
    - Copy kernels: with `ddp_config.fsdp_copy_kernels` megatron_fsdp's C++/CUDA
      kernels serve FSDP2's copy-in and copy-out ops (for the whole process,
      as the op registry is); `fsdp_copy_kernels_active` says whether they
      do. Without it, stock FSDP2.
    - Gradient accumulation: as in Megatron-Core, no_sync() changes nothing and
      every microbatch reduce-scatters into the sharded gradients, unless
      `ddp_config.accumulate_unsharded_grads_in_no_sync` trades a full
      unsharded gradient per rank for one reduce-scatter per step.
    - Meta device: a model built under `torch.device("meta")` (or with
      `config.init_model_with_meta_device`) is materialized shard by shard
      and initialized here, each rank drawing only its part, seeded from the
      current generator state (megatron_fsdp.initialization): the same full
      weights at every layout and through megatron_fsdp.fully_shard, though
      not the ones an eager build draws.
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
        plan = plan_fsdp(config, ddp_config, module, sub_modules_to_wrap, disable_bucketing, process_group)
        apply_fsdp_plan(module, plan)
        self.ddp_config = ddp_config
        self.disable_bucketing = disable_bucketing
        self.sub_modules_to_wrap = plan.wrap_classes
        self.device_mesh = plan.mesh
        self.process_group = plan.process_group
        self.reshard_after_forward = plan.reshard_after_forward
        self.cpu_offload = plan.cpu_offload  # the optimizer must step on the CPU (optimizer_cpu_offload)
        self.fsdp_units_in_forward_order = list(plan.units)
        self.fsdp_units = list(reversed(plan.units))  # in the order they were sharded
        self.fsdp_copy_kernels_active = plan.copy_kernels and _copy_kernels_installed()
        self.accumulate_unsharded_grads = getattr(ddp_config, "accumulate_unsharded_grads_in_no_sync", False)
        self._in_no_sync = False
        self._unsynced_backward = False

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
        drop_unsharded_grads(self.module)
        self._unsynced_backward = False

    def unsharded_grad_bytes(self) -> int:
        """Bytes this rank holds in unsharded gradients awaiting a
        reduce-scatter: zero between microbatches unless
        `accumulate_unsharded_grads_in_no_sync` is on."""
        held = 0
        for fsdp_param in _torch_compat.fsdp_params(self.module):
            for grad in _torch_compat.unsharded_grads(fsdp_param):
                local = grad.to_local() if isinstance(grad, DTensor) else grad
                held += local.numel() * local.element_size()
        return held

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
            raise_on_bad_grads(self.module, device=parallel_state.get_device_or_cpu())

    def broadcast_params(self) -> None:
        """Each shard has one owner per replica: broadcast shards across HSDP
        replicas, and buffers across all data-parallel ranks."""
        broadcast_fsdp_params(self.module, self.device_mesh, self.process_group)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the sharded parameters in place: values may be DTensors
        sharded like the model's, or full tensors (each rank keeps its shard).
        State derived from the weights follows through the model's own
        load_state_dict post-hooks (the fp8 converter's scales)."""
        return load_fsdp_state_dict(self.module, state_dict, strict)
