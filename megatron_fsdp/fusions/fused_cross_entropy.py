"""Megatron-Core's fused vocabulary-parallel cross entropy (`cross_entropy_loss_fusion`,
`--cross-entropy-loss-fusion`; megatron.core.fusions.fused_cross_entropy).

Megatron's fused function computes what the unfused one does (fp32 arithmetic on the logits,
one all-reduce of the max and one of the target's logit and the sum of exponentials over the
tensor-parallel group) with its elementwise steps fused, and rounds the logits' gradient once to
bf16 (hard-coded: the logits' dtype in a bf16 run). Here the gradient is rounded once to the
logits' dtype, whatever it is. On CUDA the forward and backward passes are one Triton kernel each
(triton_cross_entropy.py), reading the logits in their own dtype: no fp32 copy of them is made or
kept. Elsewhere (the CPU) it is the unfused function on the fp32 logits, whose gradient autograd
rounds once to the logits' dtype. fp16_lm_cross_entropy does not apply with the fusion, as in
Megatron.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import parallel_state
from ..tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from ..utils import triton_kernels_for


def _kernels_for(logits: torch.Tensor):
    """triton_cross_entropy for a CUDA tensor where Triton is installed, else None (the eager path)."""
    return triton_kernels_for(logits, "megatron_fsdp.fusions.triton_cross_entropy")


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        kernels = _kernels_for(logits)
        world = dist.get_world_size(group) if group is not None else 1
        vocab_per_rank = logits.size(-1)
        vocab_start = dist.get_rank(group) * vocab_per_rank if world > 1 else 0
        rows, targets = logits.reshape(-1, vocab_per_rank), target.reshape(-1).long().contiguous()
        logits_max, sum_exp, predicted = kernels.cross_entropy_stats(rows, targets, vocab_start)
        if world > 1:
            # Each rank's sum of exponentials is relative to its own max: rescale it to the global one.
            global_max = logits_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            sum_exp = sum_exp * torch.exp(logits_max - global_max)
            packed = torch.stack([predicted, sum_exp])  # one all-reduce for both, as Megatron's
            dist.all_reduce(packed, group=group)
            logits_max, (predicted, sum_exp) = global_max, packed
        # Megatron's loss: log(sum of exp(logit - max)) - (target's logit - max), the second term 0
        # for a target outside the vocabulary (an ignore index such as -100), as Megatron masks it.
        in_vocabulary = (targets >= 0) & (targets < vocab_per_rank * world)
        loss = sum_exp.log() - torch.where(in_vocabulary, predicted - logits_max, 0.0)
        ctx.save_for_backward(rows, targets, logits_max, sum_exp)
        ctx.vocab_start, ctx.logits_shape = vocab_start, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        rows, targets, logits_max, sum_exp = ctx.saved_tensors
        dlogits = _kernels_for(rows).cross_entropy_bwd(rows, targets, logits_max, sum_exp, grad_loss.reshape(-1),
                                                       ctx.vocab_start)
        return dlogits.view(ctx.logits_shape), None, None


def fused_vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                       tp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Per-token cross entropy in fp32 from this TP rank's slice of the vocabulary
    `vocab_parallel_logits` [s, b, vocab/tp] (any float dtype) and the global token ids `target`
    [s, b]; the logits' gradient comes in their dtype. `tp_group`: parallel_state's
    tensor-parallel group when None."""
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"fused_vocab_parallel_cross_entropy: logits shape {tuple(vocab_parallel_logits.shape)} "
                         f"does not match target shape {tuple(target.shape)} (expected logits [..., vocab/tp] "
                         f"for target [...])")
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if _kernels_for(vocab_parallel_logits) is None:
        return vocab_parallel_cross_entropy(vocab_parallel_logits.float(), target, tp_group=tp_group)
    return _FusedVocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)
