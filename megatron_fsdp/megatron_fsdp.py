"""`MegatronFSDP`: the model `fully_shard_model` returns (NVIDIA Megatron-FSDP's class, on FSDP2).

The wrapped module (`.module`) holds FSDP2's sharded parameters (DTensors);
this class adds NVIDIA's training-loop interface: gradient synchronization
control (`set_model_auto_sync`, `no_sync`, `sync`), `finish_grad_sync`,
`zero_grad_buffer`, `broadcast_params`, and state dicts DCP saves and loads.

When gradients are reduced: every backward while auto-sync is on (the
default, `sync_model_each_microbatch=True`) or once `no_sync()` has been left
(NVIDIA's `is_last_microbatch`); otherwise FSDP2 accumulates unsharded
gradients without communication and the sharded `.grad`s stay empty until
the synchronizing backward reduces everything that accumulated.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .distributed.data_parallel_base import _BaseDataParallel
from .distributed.fsdp_plan import _materialization_device
from .distributed.outer_sharding import OuterShardedOptimizerState
from .distributed.torch_fully_sharded_data_parallel import (broadcast_fsdp_params, drop_unsharded_grads,
                                                            load_fsdp_state_dict, raise_on_bad_grads)


class MegatronFSDP(_BaseDataParallel):
    def __init__(self, module: nn.Module, device_mesh: DeviceMesh, process_group: dist.ProcessGroup, *,
                 zero_dp_strategy: str, sync_model_each_microbatch: bool = True,
                 report_nan_in_param_grad: bool = False,
                 outer_shards: Optional[OuterShardedOptimizerState] = None):
        super().__init__(config=None, module=module)
        # HFSDP (outer_dp_sharding_strategy "optim"): the optimizer's pieces of the shards.
        self.outer_shards = outer_shards
        self.device_mesh = device_mesh
        self.process_group = process_group
        self.data_parallel_sharding_strategy = zero_dp_strategy
        self.report_nan_in_param_grad = report_nan_in_param_grad
        self.model_auto_sync = sync_model_each_microbatch
        self.is_last_microbatch = False
        self._requires_gradient_sync = True  # FSDP2's default

    def forward(self, *inputs, **kwargs):
        if self.outer_shards is not None and not self.outer_shards.attached:
            raise RuntimeError("outer_dp_sharding_strategy 'optim' (HFSDP): the optimizer must step the outer "
                               "shards; build it on the module's parameters and pass it through fully_shard or "
                               "fully_shard_optimizer before the first forward")
        if torch.is_grad_enabled():
            sync = self.model_auto_sync or self.is_last_microbatch
            if sync != self._requires_gradient_sync:  # a walk over every unit: only on a change
                self.module.set_requires_gradient_sync(sync)
                self._requires_gradient_sync = sync
        return self.module(*inputs, **kwargs)

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        """True: reduce gradients in every backward; False: only in the backward of a forward
        run outside `no_sync()` after leaving it (the last microbatch)."""
        if not isinstance(sync_model, bool):
            raise TypeError(f"set_model_auto_sync: sync_model must be True or False, got {sync_model!r}")
        self.model_auto_sync = sync_model

    @contextmanager
    def no_sync(self):
        """Backward passes of forwards run inside accumulate without communication (with
        auto-sync off); the first one after it reduces everything."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    @contextmanager
    def sync(self):
        """Auto-sync on inside, off after (NVIDIA's)."""
        self.set_model_auto_sync(True)
        try:
            yield
        finally:
            self.set_model_auto_sync(False)

    def start_grad_sync(self, *unused) -> None:
        """No-op: FSDP2 launches each unit's reduction during backward."""

    def synchronize_gradient_reduce(self) -> None:
        """No-op: FSDP2 waits for every reduction at the end of backward."""

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """No-op: FSDP2 gathers each unit's parameters in its pre-forward hook (prefetching the next)."""

    def synchronize_param_gather(self) -> None:
        """No-op: FSDP2 waits for a unit's gather before its forward runs."""

    def install_optimized_model_weights(self) -> None:
        """No-op: the sharded parameters the optimizer updates are the ones FSDP2 gathers (they are
        the main weights), so there is nothing to copy after `optimizer.step()`."""

    def finish_grad_sync(self, force_all_reduce: Optional[bool] = False) -> None:
        """FSDP2 waits for its reductions at the end of backward; with report_nan_in_param_grad,
        raises on every rank naming the parameters whose gradient holds a NaN. HFSDP: then
        reduces the gradients across the outer dimension into the optimizer's parameters (else
        `optimizer.step()` does), where a gradient norm is taken from then on."""
        if self.report_nan_in_param_grad:
            raise_on_bad_grads(self.module, device=_materialization_device(self.device_mesh),
                               group=self.process_group, nan_only=True)
        if self.outer_shards is not None:
            self.outer_shards.reduce_gradients()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient by `scaling_factor`: HFSDP's reduced ones on the optimizer's
        pieces too (finalize_model_grads scales after finish_grad_sync)."""
        super().scale_gradients(scaling_factor)
        if self.outer_shards is not None:
            self.outer_shards.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Drop every gradient, the unsharded ones accumulated without synchronization included."""
        super().zero_grad_buffer()
        drop_unsharded_grads(self.module)
        if self.outer_shards is not None:
            self.outer_shards.zero_grad()

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load in place: DTensors sharded like the model's (a DCP load), or full tensors (a
        plain model's state dict: each rank keeps its shard)."""
        return load_fsdp_state_dict(self.module, state_dict, strict)

    def broadcast_params(self) -> None:
        """Make every data-parallel replica hold rank 0's parameters and buffers."""
        broadcast_fsdp_params(self.module, self.device_mesh, self.process_group)
