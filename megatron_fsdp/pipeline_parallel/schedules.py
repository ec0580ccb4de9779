"""Megatron-Core's forward-backward schedule without pipelining.

`forward_backward_no_pipelining` runs `num_microbatches` forward and backward
passes, every one but the last inside `config.no_sync_func()` (the
data-parallel wrapper's `no_sync`), so that gradient synchronization is
completed with the last one, then calls `config.finalize_model_grads_func`.
Losses are scaled as in Megatron: a loss function returning
`(loss, num_tokens, report)` has its loss divided by the tokens and by the
number of microbatches; one returning `(loss, report)` is divided by the
number of microbatches (and multiplied by the context-parallel size). The
reports of every microbatch are returned in order. Megatron's per-token mode
(`config.calculate_per_token_loss`), `pg_collection` and `force_all_reduce`
are refused before the first microbatch runs.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Union

import torch

from .. import parallel_state
from ..utils import check_positive_int, get_model_config, reject_unsupported


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None,
                              schedule_pg_collection=None) -> Callable:
    """The schedule for the current pipeline layout: without pipeline
    parallelism (the only layout megatron_fsdp has), forward_backward_no_pipelining."""
    if pp_size is None and vp_size is None and parallel_state.model_parallel_is_initialized():
        pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    reject_unsupported("get_forward_backward_func", {
        "pp_size": (pp_size or 1, 1, "pipeline parallelism is not implemented"),
        "vp_size": (vp_size, None, "virtual pipeline parallelism is not implemented"),
        "schedule_pg_collection": (schedule_pg_collection, None, "multi-module schedules are not implemented"),
    })
    return forward_backward_no_pipelining


def check_first_val_step(first_val_step: Optional[bool], forward_only: bool, cond: bool) -> bool:
    if first_val_step is not None and forward_only:
        return first_val_step and cond
    return cond


def _timer(config, name: str, log_level: int):
    timers = getattr(config, "timers", None)
    return None if timers is None else timers(name, log_level=log_level)


def forward_step(forward_step_func, data_iterator, model, num_microbatches: int, input_tensor, forward_data_store,
                 config, cp_group_size: Optional[int] = None, collect_non_loss_data: bool = False,
                 checkpoint_activations_microbatch=None, is_first_microbatch: bool = False,
                 current_microbatch: Optional[int] = None, vp_stage=None, is_last_stage: bool = True):
    """One microbatch's forward and loss; returns (scaled loss, number of tokens).
    `is_first_microbatch`, `current_microbatch`, `vp_stage` and `is_last_stage`
    are Megatron's signature: nothing here depends on them (no fp8 weight cache
    to refresh, no pipeline)."""
    timer = _timer(config, "forward-compute", 2)
    if timer is not None:
        timer.start()
    if checkpoint_activations_microbatch is None:
        output_tensor, loss_func = forward_step_func(data_iterator, model)
    else:
        output_tensor, loss_func = forward_step_func(data_iterator, model, checkpoint_activations_microbatch)
    if cp_group_size is None:
        cp_group_size = (parallel_state.get_context_parallel_world_size()
                         if parallel_state.model_parallel_is_initialized() else 1)
    num_tokens = torch.tensor(0, dtype=torch.int)
    if loss_func is None:
        forward_data_store.append(output_tensor)
    elif collect_non_loss_data:
        forward_data_store.append(loss_func(output_tensor, non_loss_data=True))
    else:
        outputs = loss_func(output_tensor)
        if len(outputs) == 3:
            output_tensor, num_tokens, loss_reduced = outputs
            # A microbatch whose tokens are all masked contributes zero, not NaN.
            output_tensor = output_tensor / torch.clamp(_tokens_of_whole_sequences(num_tokens, cp_group_size),
                                                        min=1) * cp_group_size
            output_tensor = output_tensor / num_microbatches
        elif len(outputs) == 2:
            output_tensor, loss_reduced = outputs
            output_tensor = output_tensor * cp_group_size / num_microbatches
        else:
            raise ValueError(f"loss_func must return (loss, report) or (loss, num_tokens, report), got "
                             f"{len(outputs)} values")
        forward_data_store.append(loss_reduced)
        if getattr(config, "num_moe_experts", None) is not None:
            _set_moe_aux_loss_scale(config, output_tensor.device, cp_group_size, num_microbatches)
    if timer is not None:
        timer.stop()
    return output_tensor, num_tokens


def _set_moe_aux_loss_scale(config, device, cp_group_size: int, num_microbatches: int) -> None:
    """The routers' auxiliary losses reach the backward scaled as the language-model loss is
    (Megatron's forward_step): the fp16 loss scale, x CP / micro-batches."""
    from ..transformer.moe.moe_utils import MoEAuxLossAutoScaler

    one = torch.ones(1, device=device)
    loss_scale = config.grad_scale_func(one) if config.grad_scale_func is not None else one
    MoEAuxLossAutoScaler.set_loss_scale(loss_scale * cp_group_size / num_microbatches)


def _tokens_of_whole_sequences(num_tokens: torch.Tensor, cp_group_size: int) -> torch.Tensor:
    """The loss's tokens in the whole sequences: under context parallelism each rank counts only its
    chunks', and dividing by those would weigh a rank with fewer unmasked tokens more (and the
    gradient, which FSDP then averages over DP x CP, would change with the CP size). Times CP
    above, the average over the CP ranks is the whole sequences' per-token mean."""
    if cp_group_size == 1:
        return num_tokens
    total = num_tokens.detach().clone()
    torch.distributed.all_reduce(total, group=parallel_state.get_context_parallel_group())
    return total


def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
    """Backward from the (scaled) loss; no pipeline, so no input gradient to return."""
    timer = _timer(config, "backward-compute", 2)
    if timer is not None:
        timer.start()
    if output_tensor_grad is None and config.grad_scale_func is not None:
        output_tensor = config.grad_scale_func(output_tensor)
    if output_tensor.requires_grad:
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)
    if timer is not None:
        timer.stop()
    return None


def forward_backward_no_pipelining(
    *,
    forward_step_func,
    data_iterator: Union[Iterator, list],
    model: Union[torch.nn.Module, list],
    num_microbatches: int,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
):
    """Run forward (and backward unless `forward_only`) over `num_microbatches`
    microbatches drawn by `forward_step_func` from `data_iterator`; returns the
    loss functions' reports, one per microbatch. `seq_length`,
    `micro_batch_size` and `decoder_seq_length` are unused without pipelining,
    as in Megatron."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(f"the schedule without pipelining takes one model chunk, got {len(model)}")
        model = model[0]
    if isinstance(data_iterator, list):
        if len(data_iterator) != 1:
            raise ValueError(f"the schedule without pipelining takes one data iterator, got {len(data_iterator)}")
        data_iterator = data_iterator[0]
    check_positive_int("num_microbatches", num_microbatches)
    config = get_model_config(model)
    reject_unsupported("forward_backward_no_pipelining", {
        "adjust_tensor_shapes_fn": (adjust_tensor_shapes_fn, None, "it applies to pipeline schedules only"),
        "pg_collection": (pg_collection, None, "process groups come from parallel_state"),
        "config.calculate_per_token_loss": (getattr(config, "calculate_per_token_loss", False), False,
                                            "each microbatch's loss is averaged over its tokens"),
        "force_all_reduce": (bool(force_all_reduce), False,
                             "FSDP keeps sharded gradients; gather full ones with DTensor.full_tensor()")})
    timer = _timer(config, "forward-backward", 1)
    if timer is not None:
        timer.start(barrier=getattr(config, "barrier_with_L1_time", False))
    no_sync_func = config.no_sync_func or contextlib.nullcontext
    forward_data_store = []

    def one_microbatch(i: int) -> None:
        output_tensor, _ = forward_step(
            forward_step_func, data_iterator, model, num_microbatches, None, forward_data_store, config,
            None, collect_non_loss_data,
            is_first_microbatch=check_first_val_step(first_val_step, forward_only, i == 0),
            current_microbatch=i)
        if not forward_only:
            backward_step(None, output_tensor, None, config)

    with no_sync_func():
        for i in range(num_microbatches - 1):
            one_microbatch(i)
    # The last microbatch runs outside no_sync: its backward completes the gradient synchronization.
    one_microbatch(num_microbatches - 1)

    if config.finalize_model_grads_func is not None and not forward_only:
        # No per-token mode: no token count for the gradients (Megatron passes None then too).
        config.finalize_model_grads_func([model], None, pg_collection=None, force_all_reduce=False)
    if timer is not None:
        timer.stop()
    return forward_data_store
