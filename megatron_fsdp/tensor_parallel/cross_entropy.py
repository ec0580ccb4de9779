"""Cross entropy over vocabulary-split logits, without gathering the vocabulary."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import parallel_state


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group):
        world_size = dist.get_world_size(group)
        vocab_per_rank = logits.size(-1)
        vocab_start = dist.get_rank(group) * vocab_per_rank
        vocab_size = vocab_per_rank * world_size

        logits_max = logits.max(dim=-1)[0]
        if world_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < vocab_start) | (target >= vocab_start + vocab_per_rank)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp_logits = shifted.exp()
        sum_exp = exp_logits.sum(dim=-1)
        if world_size > 1:
            # One all-reduce for both partial sums.
            packed = torch.stack([predicted, sum_exp])
            dist.all_reduce(packed, group=group)
            predicted, sum_exp = packed[0], packed[1]
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - predicted
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))

        if label_smoothing > 0:
            # loss = (1 - eps) * nll + eps * mean over the vocabulary of -log p
            mean_log_probs = (shifted - log_sum_exp.unsqueeze(-1)).sum(dim=-1)
            if world_size > 1:
                dist.all_reduce(mean_log_probs, group=group)
            mean_log_probs = mean_log_probs / vocab_size
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_probs

        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # reused in place: softmax is not needed afterwards
        one_hot_weight = (~outside).to(grad.dtype) * (1.0 - ctx.label_smoothing)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot_weight.unsqueeze(-1))
        if ctx.label_smoothing > 0:
            grad.sub_(ctx.label_smoothing / ctx.vocab_size)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0,
                                 tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Per-token cross entropy; `vocab_parallel_logits` [..., vocab/tp] holds this
    TP rank's slice of the vocabulary, `target` [...] the global token ids.
    `tp_group`: parallel_state's tensor-parallel group when None."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(vocab_parallel_logits.shape)} does not match target shape "
            f"{tuple(target.shape)} (expected logits [..., vocab/tp] for target [...])"
        )
    group = parallel_state.get_tensor_model_parallel_group() if tp_group is None else tp_group
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, group)
