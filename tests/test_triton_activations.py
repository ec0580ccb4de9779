"""The Triton kernels of the fused bias-GELU / GeGLU / SwiGLU against the eager
fp32 path (Megatron's formulas, fused_activations.py), forward and backward,
with fc1's [gate; up] halves, with and without bias, in fp32, bf16 and fp16.

On the GPU or under Triton's interpreter (triton_testing.py).
"""

import pytest
import torch

from triton_testing import DEVICE, ON_GPU, ONE_ULP, assert_compiled_equals_eager  # first
from megatron_fsdp.transformer import fused_activations
from megatron_fsdp.transformer import triton_activations as ta

# fp32: the reference's own rounding where tanh nears +-1 (it forms 1 + t and 1 - t * t from a
# rounded t; the kernels compute both without cancellation) bounds the difference: at most about
# 1e-7 * |x|^3 * |grad| for the GELU derivative, 5e-6 absolute in these cases; an ulp of the value
# elsewhere. bf16/fp16: the same fp32 value rounded once, so at most an ulp of the dtype apart.
TOLERANCE = {**ONE_ULP, torch.float32: dict(rtol=4e-6, atol=1e-5)}


def _case(kind, dtype, bias, rows=37, width=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * width if kind != "gelu" else width
    y = (torch.randn(rows, 3, C, generator=g) * 3).to(dtype)
    y.view(-1)[:6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 1e-4, -12.0])  # tanh's ends, small values
    b = (torch.randn(C, generator=g)).to(dtype) if bias else None
    return y.to(DEVICE), (b.to(DEVICE) if b is not None else None)


@pytest.mark.parametrize("kind", ["gelu", "geglu", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_match_the_eager_fp32_formulas(kind, dtype, bias, rows=37, width=96):
    y, b = _case(kind, dtype, bias, rows=rows, width=width)
    out = ta.bias_act_fwd(y, b, ta.CODES[kind])
    x = fused_activations._biased_fp32(y, b)
    want = fused_activations._forward_fp32(x, kind).to(dtype)
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out, want, **TOLERANCE[dtype])

    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    dy = ta.bias_act_bwd(grad_out, y, b, ta.CODES[kind])
    want_dy = fused_activations._backward_fp32(grad_out.float(), x, kind).to(dtype)
    torch.testing.assert_close(dy, want_dy, **TOLERANCE[dtype])


@pytest.mark.parametrize("kind", ["gelu", "swiglu", "geglu"])
def test_rows_wider_than_a_block_of_the_grid(kind):
    """A row of 1100 outputs spans two column blocks of the 2-D grid (1024 wide), the second
    masked; 2 x 3 rows."""
    test_kernels_match_the_eager_fp32_formulas(kind, torch.float32, True, rows=2, width=1100)


@pytest.mark.parametrize("kind", ["gelu", "geglu", "swiglu"])
def test_autograd_takes_the_kernels_and_gives_the_eager_gradients(kind, monkeypatch):
    y, b = _case(kind, torch.float32, bias=True, rows=5, width=40)
    grad_out = torch.randn(5, 3, 40, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    results = []
    for use_kernels in (False, True):
        monkeypatch.setattr(fused_activations, "_kernels_for", lambda t: ta if use_kernels else None)
        yy, bb = y.clone().requires_grad_(), b.clone().requires_grad_()
        out = fused_activations.bias_activation(yy, bb, kind)
        out.backward(grad_out)
        results.append((out.detach(), yy.grad, bb.grad))
    for eager, kernel in zip(*results):
        torch.testing.assert_close(kernel, eager, **TOLERANCE[torch.float32])


def test_only_cuda_tensors_take_the_kernels():
    """Every eager path's dispatch to its Triton module (utils.triton_kernels_for): the activations',
    RoPE's, bias-dropout-add's and the fused cross entropy's."""
    from megatron_fsdp.fusions import fused_cross_entropy, triton_cross_entropy
    from megatron_fsdp.models.common.embeddings import rotary_pos_embedding, triton_rope
    from megatron_fsdp.transformer import transformer_layer, triton_bias_dropout_add

    for dispatch, kernels in ((fused_activations._kernels_for, ta), (rotary_pos_embedding._kernels_for, triton_rope),
                              (transformer_layer._kernels_for, triton_bias_dropout_add),
                              (fused_cross_entropy._kernels_for, triton_cross_entropy)):
        assert dispatch(torch.ones(2)) is None
        if ON_GPU:
            assert dispatch(torch.ones(2, device="cuda")) is kernels


def test_bad_arguments_are_named():
    y = torch.ones(4, 7, device=DEVICE)
    with pytest.raises(ValueError, match="gated activation needs an even last dimension"):
        ta.bias_act_fwd(y, None, ta.SWIGLU)
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(8,\)"):
        ta.bias_act_fwd(torch.ones(4, 8, device=DEVICE), torch.ones(3, device=DEVICE), ta.GEGLU)
    with pytest.raises(ValueError, match="kind code 7, allowed"):
        ta.bias_act_fwd(torch.ones(4, 8, device=DEVICE), None, 7)
    with pytest.raises(ValueError, match=r"grad_out has shape \(4, 8\), expected \(4, 4\)"):
        ta.bias_act_bwd(torch.ones(4, 8, device=DEVICE), torch.ones(4, 8, device=DEVICE), None, ta.SWIGLU)


def test_empty_input():
    y = torch.ones(0, 8, device=DEVICE)
    assert ta.bias_act_fwd(y, None, ta.SWIGLU).shape == (0, 4)
    assert ta.bias_act_bwd(torch.ones(0, 4, device=DEVICE), y, None, ta.SWIGLU).shape == (0, 8)


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of a Triton op needs the GPU")
@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_the_kernels_compose_with_torch_compile(kind):
    y, b = _case(kind, torch.bfloat16, bias=kind == "gelu")
    grad_out = torch.randn(*y.shape[:-1], y.shape[-1] // (2 if kind == "swiglu" else 1), device=DEVICE,
                           dtype=torch.bfloat16)
    assert_compiled_equals_eager(fused_activations.bias_activation, [y], b, kind, grad_out=grad_out)
