"""The fused vocabulary-parallel cross entropy's two Triton kernels (CUDA tensors;
fused_cross_entropy.py keeps the eager path for the CPU).

Megatron's cross entropy makes an fp32 copy of the logits, passes over it about six times
forward and three times backward and keeps the fp32 softmax for backward: for bf16 logits (tokens
x vocabulary, the model's largest activation) about 50 bytes of memory traffic per logit. Here
forward reads the logits once in their own dtype (an online max and sum of exponentials per row,
and the target's logit) and backward reads them once more and writes their gradient once, in
fp32 arithmetic rounded once to the logits' dtype: 6 bytes per bf16 logit. Beyond the logits
themselves, two fp32 numbers per row are kept for backward.

The kernels are torch.library.triton_op operators (megatron_fsdp::cross_entropy_stats,
::cross_entropy_bwd), so torch.compile sees through them. Importing this module needs Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from .._triton_launch import traceable

_BLOCK = 4096


# V is a compile-time constant (one kernel per vocabulary slice width, one in a run): the loop's
# bound is then a Python int, as Triton 3.6's interpreter needs (it cannot take int() of a kernel
# argument under NumPy 2), and the compiler knows the trip count.
@triton.jit
def _ce_stats_kernel(logits_ptr, target_ptr, max_ptr, sum_exp_ptr, predicted_ptr, row_stride, vocab_start,
                     V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        j = start + tl.arange(0, BLOCK)
        x = tl.load(base + j, mask=j < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        # While every logit so far is -inf (masked vocabulary), exp(-inf - -inf) would be NaN:
        # shift by 0 instead, which keeps the sum at 0 until a finite logit comes.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
    t = tl.load(target_ptr + row) - vocab_start
    inside = (t >= 0) & (t < V)
    predicted = tl.load(base + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, m)
    tl.store(sum_exp_ptr + row, s)
    tl.store(predicted_ptr + row, predicted)


@triton.jit
def _ce_bwd_kernel(logits_ptr, target_ptr, max_ptr, sum_exp_ptr, grad_ptr, dlogits_ptr, V, row_stride, vocab_start,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < V
    x = tl.load(logits_ptr + row * row_stride + j, mask=mask, other=0.0).to(tl.float32)
    softmax = tl.exp(x - tl.load(max_ptr + row)) / tl.load(sum_exp_ptr + row)
    t = tl.load(target_ptr + row) - vocab_start
    d = tl.where(j == t, softmax - 1.0, softmax) * tl.load(grad_ptr + row)
    tl.store(dlogits_ptr + row * V + j, d.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _check(name: str, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(logits with unit stride along the vocabulary, contiguous targets, the slice's width)."""
    if logits.dim() != 2 or target.shape != logits.shape[:1] or target.dtype != torch.int64 or not logits.shape[1]:
        raise ValueError(f"{name}: expected logits [tokens, vocab > 0] and int64 targets [tokens], got logits "
                         f"{tuple(logits.shape)} and {target.dtype} targets {tuple(target.shape)}")
    return (logits if logits.stride(-1) == 1 else logits.contiguous()), target.contiguous(), logits.shape[1]


@triton_op("megatron_fsdp::cross_entropy_stats", mutates_args=())
def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor,
                        vocab_start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of this rank's logits [tokens, vocab slice], in fp32: the max, the sum of
    exp(logit - max), and the target's logit (0 where the target is outside the slice that
    starts at global id `vocab_start`)."""
    logits, target, V = _check("cross_entropy_stats", logits, target)
    n = logits.shape[0]
    stats = [torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3)]
    if n:
        traceable(_ce_stats_kernel)[(n,)](logits, target, *stats, logits.stride(0), vocab_start, V=V,
                                          BLOCK=min(_BLOCK, triton.next_power_of_2(V)), num_warps=8)
    return stats[0], stats[1], stats[2]


@triton_op("megatron_fsdp::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor, sum_exp: torch.Tensor,
                      grad_loss: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """The gradient of the logits (their dtype, contiguous) from the per-row loss gradient:
    (exp(logit - max) / sum_exp - [the target's column]) * grad, in fp32, the max and sum of
    exponentials being the whole vocabulary's."""
    logits, target, V = _check("cross_entropy_bwd", logits, target)
    n = logits.shape[0]
    dlogits = torch.empty((n, V), dtype=logits.dtype, device=logits.device)
    if n:
        block = min(_BLOCK, triton.next_power_of_2(V))
        traceable(_ce_bwd_kernel)[(n, triton.cdiv(V, block))](
            logits, target, logits_max, sum_exp, grad_loss.float().contiguous(), dlogits, V, logits.stride(0),
            vocab_start, BLOCK=block, num_warps=8)
    return dlogits
