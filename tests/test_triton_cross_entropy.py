"""The fused cross entropy's Triton kernels (megatron_fsdp/fusions) against torch's cross entropy
in float64: the loss and the logits' gradient in fp32, bf16 and fp16 logits, a vocabulary of
one block and one of several (the online max and sum across blocks), logits large enough that
exp() would overflow without the max, targets at both ends of the vocabulary; and split over
two tensor-parallel ranks, each holding half of the vocabulary.

On the GPU or under Triton's interpreter (triton_testing.py).
"""

import pytest
import torch
import torch.nn.functional as F

from triton_testing import DEVICE  # first
from helpers import setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.fusions import fused_cross_entropy as fce
from megatron_fsdp.fusions import triton_cross_entropy as tce

S, B = 7, 3
# The loss is fp32 arithmetic in a different order (and, on a GPU, Triton's exp); the gradient is
# that rounded once to the logits' dtype.
LOSS = dict(rtol=2e-6, atol=2e-5)
GRAD = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.bfloat16: dict(rtol=8e-3, atol=1e-6),
        torch.float16: dict(rtol=1e-3, atol=1e-7)}


def _inputs(V: int, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Spread-out logits around 100: a missing max-subtraction would overflow exp().
    logits = (torch.randn(S, B, V, generator=g) * 8 + 100).to(dtype)
    target = torch.randint(0, V, (S, B), generator=g)
    target[0] = torch.tensor([0, V - 1, V // 2])
    weights = torch.rand(S, B, generator=g)
    return logits, target, weights


def _dense(logits, target, weights):
    """torch's cross entropy in float64: the loss, and the logits' gradient for the loss weights."""
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)
    (loss * weights.double()).sum().backward()
    return loss.detach(), x.grad


def _fused(logits, target, weights, group=None):
    x = logits.detach().clone().to(DEVICE).requires_grad_()
    loss = fce._FusedVocabParallelCrossEntropy.apply(x, target.to(DEVICE), group)
    (loss * weights.to(DEVICE)).sum().backward()
    return loss.detach().cpu(), x.grad.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [37, 2 * tce._BLOCK + 77])  # one block; two whole blocks and a ragged one
def test_the_kernels_give_torchs_loss_and_gradient(dtype, V, monkeypatch):
    monkeypatch.setattr(fce, "_kernels_for", lambda t: tce)
    logits, target, weights = _inputs(V, dtype)
    want_loss, want_grad = _dense(logits, target, weights)
    loss, grad = _fused(logits, target, weights)
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss, want_loss.float(), **LOSS)
    torch.testing.assert_close(grad, want_grad.to(dtype), **GRAD[dtype])


def test_strided_rows_and_int32_targets(monkeypatch):
    """Logits whose rows are apart in memory (a slice of a wider tensor) and int32 targets."""
    monkeypatch.setattr(fce, "_kernels_for", lambda t: tce)
    V = 50
    wide, target, weights = _inputs(V + 14, torch.float32, seed=1)
    target = target.clamp(max=V - 1)
    want_loss, want_grad = _dense(wide[..., :V], target, weights)
    x = wide.to(DEVICE).requires_grad_()
    logits = x[..., :V]
    assert logits.reshape(-1, V).stride() == (V + 14, 1)  # the kernels get the rows where they are
    loss = fce._FusedVocabParallelCrossEntropy.apply(logits, target.int().to(DEVICE), None)
    (loss * weights.to(DEVICE)).sum().backward()
    torch.testing.assert_close(loss.detach().cpu(), want_loss.float(), **LOSS)
    torch.testing.assert_close(x.grad[..., :V].cpu(), want_grad.float(), **GRAD[torch.float32])
    assert not x.grad[..., V:].any()


def test_the_ops_reject_what_they_cannot_read():
    logits = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"expected logits \[tokens, vocab\] and int64 targets"):
        tce.cross_entropy_stats(logits, torch.zeros(5, dtype=torch.int64, device=DEVICE), 0)
    with pytest.raises(ValueError, match=r"does not match target shape \(2, 3\)"):
        fce.fused_vocab_parallel_cross_entropy(torch.zeros(2, 2, 8), torch.zeros(2, 3, dtype=torch.int64))


def _case_vocab_parallel(tp: int, dtype) -> None:
    """Each TP rank holds its slice of the vocabulary; loss and gradient slice against the dense."""
    setup_parallel(tp)
    kernels_for = fce._kernels_for
    try:
        fce._kernels_for = lambda t: tce
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        V = 2 * 300
        logits, target, weights = _inputs(V, dtype, seed=2)
        want_loss, want_grad = _dense(logits, target, weights)
        x = logits.chunk(tp, dim=-1)[tp_rank].clone().to(DEVICE).requires_grad_()
        loss = fce.fused_vocab_parallel_cross_entropy(x, target.to(DEVICE))  # parallel_state's TP group
        (loss * weights.to(DEVICE)).sum().backward()
        torch.testing.assert_close(loss.detach().cpu(), want_loss.float(), **LOSS)
        torch.testing.assert_close(x.grad.cpu(), want_grad.to(dtype).chunk(tp, dim=-1)[tp_rank], **GRAD[dtype])
    finally:
        fce._kernels_for = kernels_for
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_vocab_parallel_kernels_give_the_dense_loss_and_gradient(pools, tp, dtype):
    pools(2).run(_case_vocab_parallel, tp, dtype)
