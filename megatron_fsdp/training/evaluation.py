"""Validation and test passes (Megatron-LM's `evaluate` and `evaluate_and_print_results`).

Each of --eval-iters evaluation iterations runs one global batch forward
only (dropout off) through the same schedule as training. A loss function
reporting [sum of losses, number of tokens] is summed over microbatches
and data-parallel ranks, so the result is the mean loss per token over
every evaluated token; a one-value report is averaged over microbatches.
The result is printed as Megatron's block, with the perplexity exp(min(20, loss)):

    -----------------------------------------------------------------------------------------
     validation loss at iteration 10 | lm loss value: 3.123456E+00 | lm loss PPL: 2.272051E+01 |
    -----------------------------------------------------------------------------------------
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from .. import parallel_state
from ..pipeline_parallel import get_forward_backward_func
from ..utils import any_rank
from .utils import print_rank_0, print_rank_last


def exit_duration_reached(args, train_start: Optional[float]) -> bool:
    """--exit-duration-in-mins has passed, as every rank agrees (a collective when the flag is set)."""
    if not args.exit_duration_in_mins or train_start is None:
        return False
    return any_rank(time.time() - train_start > 60 * args.exit_duration_in_mins, device=parallel_state.get_device())


def evaluate(forward_step_func, data_iterator, model, config, args, eval_iters: Optional[int] = None,
             verbose: bool = False, train_start: Optional[float] = None):
    """(mean loss per key, time_limit_hit). Advances args.consumed_valid_samples."""
    eval_iters = args.eval_iters if eval_iters is None else eval_iters
    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        chunk.eval()
    dp = parallel_state.get_data_parallel_world_size()
    eval_batch_size = args.global_batch_size
    num_microbatches = eval_batch_size // (args.micro_batch_size * dp)
    forward_backward_func = get_forward_backward_func()
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    totals: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            if verbose:
                print_rank_0(f"Evaluating on {eval_iters * eval_batch_size} samples")
            for iteration in range(1, eval_iters + 1):
                if verbose:
                    print_rank_0(f"Evaluating iter {iteration}/{eval_iters}")
                reports = forward_backward_func(
                    forward_step_func=forward_step_func, data_iterator=data_iterator, model=chunks,
                    num_microbatches=num_microbatches, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, forward_only=True)
                for key in reports[0]:
                    total = totals.setdefault(key, torch.zeros(2, device=parallel_state.get_device()))
                    values = [r[key].detach().float().view(-1) for r in reports]
                    if values[0].numel() == 2:
                        summed = torch.stack(values).sum(dim=0)
                        dist.all_reduce(summed, group=group)
                        total += summed
                    elif values[0].numel() == 1:
                        total[0] += torch.cat(values).sum()
                        total[1] += len(values)
                    else:
                        raise ValueError(f"loss report {key!r} must hold 1 or 2 values, got {values[0].numel()}")
                args.consumed_valid_samples += eval_batch_size
                if exit_duration_reached(args, train_start):
                    print_rank_0("Exiting during evaluation, timelimit reached")
                    return None, True
    finally:
        for chunk in chunks:
            chunk.train()
    return {key: (total[0] / total[1]).item() for key, total in totals.items()}, False


def evaluate_and_print_results(prefix: str, forward_step_func, data_iterator, model, iteration: int, config, args,
                               logger=None, verbose: bool = False, write_to_tensorboard: bool = True,
                               train_start: Optional[float] = None) -> bool:
    """Evaluate and print Megatron's validation block; True when the
    --exit-duration-in-mins limit was hit during evaluation."""
    results, time_up = evaluate(forward_step_func, data_iterator, model, config, args, verbose=verbose,
                                train_start=train_start)
    if time_up:
        return True
    text = f" validation loss at {prefix} | "
    for key, value in results.items():
        text += f"{key} value: {value:.6E} | {key} PPL: {math.exp(min(20.0, value)):.6E} | "
        if logger is not None and write_to_tensorboard:
            logger.validation(key, value, iteration)
    rule = "-" * (len(text) + 1)
    print_rank_last(rule)
    print_rank_last(text)
    print_rank_last(rule)
    return False
