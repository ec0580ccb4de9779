"""The fused cross entropy's Triton kernels (megatron_fsdp/fusions) against torch's cross entropy
in float64: the loss and the logits' gradient in fp32, bf16 and fp16 logits, a vocabulary of
one block and one of several (the online max and sum across blocks), logits large enough that
exp() would overflow without the max, targets at both ends of the vocabulary and outside it
(Megatron's masked term), masked logits at -inf, strided logits and targets; split over two
tensor-parallel ranks, each holding half of the vocabulary; GPTModel's loss with the fusion
against the flag off; and, where megatron-core is importable (the CUDA build check), Megatron-Core's
own fused function on the same inputs.

On the GPU or under Triton's interpreter (triton_testing.py).
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

from triton_testing import DEVICE, ON_GPU  # first
from helpers import full_grads, make_config, setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.fusions import fused_cross_entropy as fce
from megatron_fsdp.fusions import triton_cross_entropy as tce

S, B = 7, 3
# The loss is fp32 arithmetic in a different order (and, on a GPU, Triton's exp); the gradient is
# that rounded once to the logits' dtype.
LOSS = dict(rtol=2e-6, atol=2e-5)
GRAD = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.bfloat16: dict(rtol=8e-3, atol=1e-6),
        torch.float16: dict(rtol=1e-3, atol=1e-7)}


@contextlib.contextmanager
def _through_the_kernels():
    """The fused function takes the Triton kernels for any tensor (CPU ones: Triton's interpreter)."""
    kernels_for = fce._kernels_for
    fce._kernels_for = lambda t: tce
    try:
        yield
    finally:
        fce._kernels_for = kernels_for


@pytest.fixture(autouse=True)
def _kernels_in_this_process():
    with _through_the_kernels():
        yield


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
def test_the_kernels_give_torchs_loss_and_gradient(dtype, V):
    logits, target, weights = _inputs(V, dtype)
    want_loss, want_grad = _dense(logits, target, weights)
    loss, grad = _fused(logits, target, weights)
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss, want_loss.float(), **LOSS)
    torch.testing.assert_close(grad, want_grad.to(dtype), **GRAD[dtype])


def test_strided_rows_and_int32_targets():
    """Logits whose rows are apart in memory (a slice of a wider tensor) and int32 targets."""
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


def test_strided_int64_targets():
    """Targets that are a strided view (every other column of a wider tensor) are read where they are."""
    logits, _, weights = _inputs(40, torch.float32, seed=3)
    wide = torch.randint(0, 40, (S, 2 * B), generator=torch.Generator().manual_seed(4))
    target = wide[:, ::2]
    assert target.stride() == (2 * B, 2)
    want_loss, want_grad = _dense(logits, target, weights)
    loss, grad = _fused(logits, target, weights)
    torch.testing.assert_close(loss, want_loss.float(), **LOSS)
    torch.testing.assert_close(grad, want_grad.float(), **GRAD[torch.float32])


def test_masked_vocabulary_at_minus_infinity():
    """Logits at -inf (a masked part of the vocabulary) in the first block of a row, or in all of it
    but the target's column: the loss and gradient stay finite, as torch's do."""
    V = tce._BLOCK + 40
    logits, target, weights = _inputs(V, torch.float32, seed=5)
    logits[..., :tce._BLOCK] = float("-inf")
    target = target.clamp(min=tce._BLOCK)
    logits[0, 0, :] = float("-inf")
    logits[0, 0, target[0, 0]] = 3.0
    want_loss, want_grad = _dense(logits, target, weights)
    loss, grad = _fused(logits, target, weights)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, want_loss.float(), **LOSS)
    torch.testing.assert_close(grad, want_grad.float(), **GRAD[torch.float32])


def test_targets_outside_the_vocabulary_give_megatrons_loss():
    """An ignore index (-100) or an id past the vocabulary: Megatron's loss log(sum exp(x - max)),
    the target's term masked, and the softmax as the gradient (the unfused function's, on fp32)."""
    V = 40
    logits, target, weights = _inputs(V, torch.float32, seed=6)
    target[1] = torch.tensor([-100, V, 5])
    outside = (target < 0) | (target >= V)
    x = logits.double().requires_grad_()
    shifted = x - x.max(dim=-1, keepdim=True).values.detach()  # Megatron's backward takes the max as a constant
    log_sum_exp = shifted.exp().sum(dim=-1).log()
    target_term = shifted.gather(-1, target.clamp(0, V - 1)[..., None])[..., 0].masked_fill(outside, 0.0)
    want = log_sum_exp - target_term
    (want * weights.double()).sum().backward()
    loss, grad = _fused(logits, target, weights)
    torch.testing.assert_close(loss, want.detach().float(), **LOSS)
    torch.testing.assert_close(grad, x.grad.float(), **GRAD[torch.float32])


def test_the_ops_reject_what_they_cannot_read():
    logits = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"expected logits \[tokens, vocab > 0\] and int64 targets"):
        tce.cross_entropy_stats(logits, torch.zeros(5, dtype=torch.int64, device=DEVICE), 0)
    with pytest.raises(ValueError, match=r"got logits \(4, 0\)"):
        tce.cross_entropy_stats(logits[:, :0], torch.zeros(4, dtype=torch.int64, device=DEVICE), 0)
    with pytest.raises(ValueError, match=r"does not match target shape \(2, 3\)"):
        fce.fused_vocab_parallel_cross_entropy(torch.zeros(2, 2, 8), torch.zeros(2, 3, dtype=torch.int64))


def _case_vocab_parallel(tp: int, dtype) -> None:
    """Each TP rank holds its slice of the vocabulary; loss and gradient slice against the dense."""
    setup_parallel(tp)
    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        V = 2 * 300
        logits, target, weights = _inputs(V, dtype, seed=2)
        logits[1, 1, :V // 2] = float("-inf")  # all of rank 0's slice of one row masked (at TP=2)
        target[1, 1] = V - 3
        want_loss, want_grad = _dense(logits, target, weights)
        x = logits.chunk(tp, dim=-1)[tp_rank].clone().to(DEVICE).requires_grad_()
        with _through_the_kernels():
            loss = fce.fused_vocab_parallel_cross_entropy(x, target.to(DEVICE))  # parallel_state's TP group
            (loss * weights.to(DEVICE)).sum().backward()
        torch.testing.assert_close(loss.detach().cpu(), want_loss.float(), **LOSS)
        torch.testing.assert_close(x.grad.cpu(), want_grad.to(dtype).chunk(tp, dim=-1)[tp_rank], **GRAD[dtype])
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp,dtype", [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)])
def test_vocab_parallel_kernels_give_the_dense_loss_and_gradient(pools, tp, dtype):
    pools(2).run(_case_vocab_parallel, tp, dtype)


def _case_gpt_model_loss(tp: int, tied: bool) -> None:
    """GPTModel's loss with cross_entropy_loss_fusion through the kernels against the flag off:
    the same per-token losses and gradients, at TP 1 and 2 with sequence parallelism, tied output
    weights or not."""
    from megatron_fsdp.models.gpt import GPTModel

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(7))
    ids[0, 3] = 63  # the vocabulary's last id: the last TP rank's slice
    results = []
    with _through_the_kernels():
        for fusion in (False, True):
            setup_parallel(tp)  # the same seed: the same weights
            config = make_config(cross_entropy_loss_fusion=fusion, sequence_parallel=tp > 1)
            model = GPTModel(config, vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=tied)
            loss = model(ids, torch.arange(16)[None], None, labels=ids)
            loss.sum().backward()
            results.append((loss.detach(), full_grads(model)))
            parallel_state.destroy_model_parallel()
    (want_loss, want_grads), (loss, grads) = results
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(ON_GPU, reason="the pool's GPT runs on the CPU, where only Triton's interpreter runs the kernels; "
                                    "on the GPU the kernel tests above run them")
@pytest.mark.parametrize("tp,tied", [(1, True), (2, False)])
def test_gpt_model_loss_through_the_kernels(pools, tp, tied):
    pools(2).run(_case_gpt_model_loss, tp, tied)


def _have_megatron_core() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def _case_megatron_cores_fused_loss(tp: int) -> None:
    """Megatron-Core's own fused_vocab_parallel_cross_entropy (its jit fuser off: the same ops run
    eagerly) and ours through the kernels, on the same bf16 vocabulary slices, an ignore index
    among the targets: the same losses and the same bf16 gradients."""
    import megatron.core.jit

    megatron.core.jit.disable_jit_fuser()  # before the fused module is imported: no torch.compile on the CPU
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy as megatrons

    setup_parallel(tp)
    try:
        group, tp_rank = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()
        logits, target, weights = _inputs(2 * 160, torch.bfloat16, seed=8)
        target[2, 1] = -100
        grads, losses = [], []
        for fused in (megatrons, fce.fused_vocab_parallel_cross_entropy):
            x = logits.chunk(tp, dim=-1)[tp_rank].clone().to(DEVICE).requires_grad_()
            with _through_the_kernels():
                loss = fused(x, target.to(DEVICE), group)
                (loss * weights.to(DEVICE)).sum().backward()
            losses.append(loss.detach().cpu())
            grads.append(x.grad.cpu())
        assert grads[0].dtype == grads[1].dtype == torch.bfloat16
        torch.testing.assert_close(losses[1], losses[0], **LOSS)
        torch.testing.assert_close(grads[1], grads[0], **GRAD[torch.bfloat16])
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.skipif(not _have_megatron_core(),
                    reason="megatron-core is not importable here (scripts/cuda_build_check.sh runs this with it)")
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_cores_fused_loss_gives_ours(pools, tp):
    pools(2).run(_case_megatron_cores_fused_loss, tp)
