"""finalize_model_grads: what Megatron-Core does to gradients between the last backward and the optimizer step.

Here that is:

- data-parallel synchronization: `finish_grad_sync()` of each wrapped chunk
  (TorchFullyShardedDataParallel waits for its reduce-scatters); a chunk
  that is not wrapped (a bare model, data-parallel by replication) has its
  gradients all-reduced and averaged over the data-parallel group here;
- no separate all-reduce of sequence-parallel layer-norm/bias gradients
  and no embedding all-reduce: megatron_fsdp's layers sum the gradients of
  parameters shared across tensor-parallel ranks inside autograd
  (`copy_to_tensor_model_parallel_region` on the parameter), and without
  pipeline parallelism the tied embedding lives on one stage;
- `num_tokens` (per-token loss): gradients end up divided by the number of
  tokens in the global batch, as in Megatron;
- with `moe_router_enable_expert_bias`, the routers' expert biases are
  updated from the step's token counts (Megatron's `_update_router_expert_bias`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import parallel_state
from ..tensor_parallel.utils import local_tensor
from ..utils import get_model_config, reject_unsupported


@torch.no_grad()
def _average_over_data_parallel(module: torch.nn.Module, group: dist.ProcessGroup, world: int) -> None:
    grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
    if not grads or world == 1:
        return
    # One flat all-reduce per dtype instead of one per parameter.
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for g, chunk in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(chunk.view_as(g))


def finalize_model_grads(model: list[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None,
                         pg_collection=None, force_all_reduce: Optional[bool] = False) -> None:
    """Finish the data-parallel gradient reduction of every chunk in `model`
    and, given `num_tokens` (this rank's token count, from a per-token loss),
    divide the gradients by the global batch's token count."""
    reject_unsupported("finalize_model_grads", {
        "force_all_reduce": (bool(force_all_reduce), False,
                             "FSDP keeps sharded gradients; gather full ones with DTensor.full_tensor()"),
        "pg_collection": (pg_collection, None, "process groups come from parallel_state")})
    config = get_model_config(model[0])
    timers = getattr(config, "timers", None)
    if timers is not None:
        timers("all-grads-sync", log_level=1).start(barrier=getattr(config, "barrier_with_L1_time", False))
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    for chunk in model:
        if hasattr(chunk, "finish_grad_sync"):
            chunk.finish_grad_sync()
        else:
            _average_over_data_parallel(chunk, dp_group, dp_size)
    if timers is not None:
        timers("all-grads-sync").stop()
    if getattr(config, "moe_router_enable_expert_bias", False):
        # Megatron's place for it: the routers' expert biases move with this step's token counts.
        from ..transformer.moe.moe_utils import _update_router_expert_bias, reset_model_temporary_tensors

        _update_router_expert_bias(model, config)
        reset_model_temporary_tensors(config, model)

    if num_tokens is not None:
        total = num_tokens.detach().clone().to(parallel_state.get_device())
        dist.all_reduce(total, group=dp_group)
        # The data-parallel reduction above averaged (divided by dp_size) where
        # Megatron's per-token mode sums, so the factor puts dp_size back.
        scaling = dp_size / torch.clamp(total, min=1).item()
        for chunk in model:
            if hasattr(chunk, "scale_gradients"):
                chunk.scale_gradients(scaling)
            else:
                with torch.no_grad():
                    for p in chunk.parameters():
                        if p.grad is not None:
                            p.grad.mul_(scaling)
