"""The Triton bias-dropout-add kernels against the eager fused path (transformer_layer.py:
fp32 arithmetic rounded once), forward and backward, with and without bias and dropout, in
fp32, bf16 and fp16; the dropout masks' rate, their determinism under the generator's state
(what activation recomputation relies on) and their regeneration in backward.

On the GPU or under Triton's interpreter (triton_testing.py).
"""

import pytest
import torch

from triton_testing import DEVICE, ON_GPU, ONE_ULP as TOLERANCE, assert_compiled_equals_eager  # first
from megatron_fsdp.transformer import transformer_layer as layer
from megatron_fsdp.transformer import triton_bias_dropout_add as tbda


def _inputs(dtype, bias: bool, shape=(33, 2, 48), seed=0):
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(shape, generator=g) * 3 for _ in range(2))
    b = torch.randn(shape[-1], generator=g) if bias else None
    to = lambda t: None if t is None else t.to(dtype).to(DEVICE).requires_grad_()  # noqa: E731
    return to(x), to(b), to(residual)


def _run(x, b, residual, p, training, kernels: bool, monkeypatch, grad=None):
    monkeypatch.setattr(layer, "_kernels_for", lambda t: tbda if kernels else None)
    xs = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, b, residual)]
    out = layer.bias_dropout_add(xs[0], xs[1], xs[2], p, training, fused=True)
    out.backward(torch.ones_like(out) if grad is None else grad)
    return out.detach(), *(t.grad if t is not None else None for t in xs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("training", [False, True])  # p = 0.3 dropout in training, none in eval
def test_without_dropout_the_kernels_give_the_eager_values_and_gradients(dtype, bias, training, monkeypatch):
    x, b, residual = _inputs(dtype, bias)
    p = 0.0 if training else 0.3
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    eager = _run(x, b, residual, p, training, False, monkeypatch, grad)
    kernel = _run(x, b, residual, p, training, True, monkeypatch, grad)
    for want, got in zip(eager, kernel):
        if want is not None:
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_dropout_masks_scale_what_they_keep_and_backward_draws_the_same(dtype, bias, monkeypatch):
    p = 0.25
    x, b, residual = _inputs(dtype, bias, shape=(64, 4, 96))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    out, dx, db, dr = _run(x, b, residual, p, True, True, monkeypatch, grad)
    assert torch.equal(dr, grad)
    kept = dx != 0  # grad has no zeros: backward's mask
    rate = kept.float().mean().item()
    n = kept.numel()
    assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5, rate  # 5 sigma
    scale = 1.0 / (1.0 - p)
    y = x.float() + (b.float() if b is not None else 0.0)
    want_out = (residual.float() + torch.where(kept, y * scale, 0.0)).to(dtype)
    torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])  # forward kept what backward kept
    want_dx = torch.where(kept, grad.float() * scale, 0.0)
    torch.testing.assert_close(dx, want_dx.to(dtype), **TOLERANCE[dtype])
    if b is not None:  # summed in fp32 before rounding
        torch.testing.assert_close(db, want_dx.sum(dim=(0, 1)).to(dtype), **TOLERANCE[dtype])


def _rng_state():
    return torch.cuda.get_rng_state() if ON_GPU else torch.get_rng_state()


def _set_rng_state(state):
    (torch.cuda.set_rng_state if ON_GPU else torch.set_rng_state)(state)


def test_the_generators_state_decides_the_mask(monkeypatch):
    x, b, residual = _inputs(torch.float32, True)
    monkeypatch.setattr(layer, "_kernels_for", lambda t: tbda)
    state = _rng_state()
    first = layer.bias_dropout_add(x, b, residual, 0.5, True, fused=True)
    second = layer.bias_dropout_add(x, b, residual, 0.5, True, fused=True)
    _set_rng_state(state)
    again = layer.bias_dropout_add(x, b, residual, 0.5, True, fused=True)
    assert torch.equal(again, first)  # a recomputation from the same state
    assert not torch.equal(second, first)  # the next call, another mask


def test_bad_arguments_are_named():
    x = torch.ones(4, 8, device=DEVICE)
    seed = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="dropout probability 1.0, allowed: 0 <= p < 1"):
        tbda.bias_dropout_add_fwd(x, None, x, seed, 1.0)
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(8,\)"):
        tbda.bias_dropout_add_fwd(x, torch.ones(3, device=DEVICE), x, seed, 0.1)
    with pytest.raises(ValueError, match=r"residual has shape \(4, 7\), expected \(4, 8\)"):
        tbda.bias_dropout_add_fwd(x, None, x[:, :7], seed, 0.1)


def test_empty_input():
    x = torch.ones(0, 8, device=DEVICE)
    seed = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert tbda.bias_dropout_add_fwd(x, None, x, seed, 0.1).shape == (0, 8)
    assert tbda.bias_dropout_add_bwd(x, seed, 0.1, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of a Triton op needs the GPU")
def test_the_kernels_compose_with_torch_compile():
    x, b, residual = _inputs(torch.bfloat16, True)
    assert_compiled_equals_eager(layer.bias_dropout_add, [x, b, residual], 0.0, True, True)
