"""The Triton RoPE kernels against the eager rotation (rotary_pos_embedding.py), forward and
backward, with Megatron's two numerics (apply_rope_fusion on and off), whole and partial
rotation, strided inputs (the key of the fused qkv layout), in fp32, bf16 and fp16; on the GPU
or under Triton's interpreter (triton_testing.py).
"""

from types import SimpleNamespace

import pytest
import torch

from triton_testing import DEVICE, ON_GPU, ONE_ULP as TOLERANCE, assert_compiled_equals_eager  # first
from megatron_fsdp.models.common.embeddings import rotary_pos_embedding as rope
from megatron_fsdp.models.common.embeddings import triton_rope

# Unfused bf16/fp16: every product and sum rounded as the eager ops round it: bit for bit on the
# GPU; elsewhere an ulp of the dtype. Triton's interpreter rounds toward zero: there the unfused
# path's three roundings are allowed two ulps of the products (|t| < 16 here), which the sum can
# cancel down to.
INTERPRETED_UNFUSED = {torch.bfloat16: dict(rtol=1.6e-2, atol=0.125), torch.float16: dict(rtol=2e-3, atol=0.016)}


def _angles(s: int, rot: int) -> torch.Tensor:
    """RotaryEmbedding's angles [s, 1, 1, rot] (each frequency twice), for positions 0..s-1."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :].to(DEVICE)


def _rotate(t, freqs, fused, grad_out, kernels: bool, monkeypatch):
    monkeypatch.setattr(rope, "_kernels_for", lambda x: triton_rope if kernels else None)
    tt = t.detach().clone().requires_grad_()
    out = rope.apply_rotary_pos_emb(tt, freqs, SimpleNamespace(apply_rope_fusion=fused))
    out.backward(grad_out)
    return out.detach(), tt.grad


def _compare(t, freqs, fused, monkeypatch, seed=1):
    grad_out = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)).to(t.dtype).to(DEVICE)
    eager = _rotate(t, freqs, fused, grad_out, False, monkeypatch)
    kernel = _rotate(t, freqs, fused, grad_out, True, monkeypatch)
    for want, got in zip(eager, kernel):
        assert got.dtype == want.dtype and got.shape == want.shape
        if not fused and t.dtype != torch.float32:
            if ON_GPU:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, **INTERPRETED_UNFUSED[t.dtype])
        else:
            torch.testing.assert_close(got, want, **TOLERANCE[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rot", [16, 8])  # the whole head (16 channels), or half of it
def test_kernels_give_the_eager_rotation_and_gradient(dtype, fused, rot, monkeypatch):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(37, 2, 3, 16, generator=g) * 4).to(dtype).to(DEVICE)
    _compare(t, _angles(64, rot), fused, monkeypatch)  # angles for more positions than t has


@pytest.mark.parametrize("fused", [False, True])
def test_strided_inputs_and_heads_wider_than_a_program(fused, monkeypatch):
    """The key of Megatron's fused qkv layout ([s, b, groups, heads + 2, head_dim], split and
    squeezed: strided rows), and a head of 4200 channels (one row per program, masked columns)."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(9, 2, 3, 4, 8, generator=g).to(torch.bfloat16).to(DEVICE)
    key = qkv[:, :, :, 2]
    assert not key.is_contiguous()
    _compare(key, _angles(9, 8), fused, monkeypatch)
    wide = torch.randn(3, 1, 2, 4200, generator=g).to(DEVICE)
    _compare(wide, _angles(3, 4096), fused, monkeypatch)


def test_bad_arguments_are_named():
    t = torch.ones(4, 1, 2, 8, device=DEVICE)
    cos = torch.ones(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"rope_fwd: expected t of shape \[s, b, heads, head_dim\], got \(4, 8\)"):
        triton_rope.rope_fwd(t[:, 0, 0], cos, cos, True)
    with pytest.raises(ValueError, match=r"cos and sin must have shape \(4, rot\), got \(3, 8\)"):
        triton_rope.rope_fwd(t, cos[:3], cos[:3], True)
    with pytest.raises(ValueError, match=r"rotated channels \(6\) must be even and at most head_dim"):
        triton_rope.rope_bwd(t[..., :4], cos[:, :6], cos[:, :6], True)
    with pytest.raises(ValueError, match="fused=False takes cos and sin in torch.bfloat16"):
        triton_rope.rope_fwd(t.bfloat16(), cos, cos, False)


def test_empty_input():
    cos = torch.ones(0, 8, device=DEVICE)
    assert triton_rope.rope_fwd(torch.ones(0, 2, 2, 8, device=DEVICE), cos, cos, True).shape == (0, 2, 2, 8)


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of a Triton op needs the GPU")
@pytest.mark.parametrize("fused", [False, True])
def test_the_kernels_compose_with_torch_compile(fused):
    t = torch.randn(64, 2, 4, 32, device=DEVICE, dtype=torch.bfloat16)
    freqs, config = _angles(64, 32), SimpleNamespace(apply_rope_fusion=fused)
    assert_compiled_equals_eager(rope.apply_rotary_pos_emb, [t], freqs, config, grad_out=torch.randn_like(t))
