"""The "rowwise" fp8 recipe (issue 20): every GEMM operand scaled per row of its reduction.
Checked against an emulation written here (each operand rounded to fp8 with its own row or
column scales, then a float64 product), against the float64 result, against tensorwise
scaling on an activation with an outlier token, in the GPT at TP1/TP2/SP, and its refusals."""

import pytest
import torch

from megatron_fsdp.fp8 import Fp8LinearState, Fp8Recipe, check_fp8_param_gather, fp8_linear
from megatron_fsdp.fp8 import gemm
from megatron_fsdp.transformer import TransformerConfig

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rounded(t: torch.Tensor, dtype, dim: int) -> torch.Tensor:
    """t rounded to fp8 with one scale per slice along `dim` (max / amax in float64, then
    float32), as float64: the operand a rowwise GEMM multiplies."""
    t = t.detach().double()
    amax = t.abs().amax(dim=dim, keepdim=True)
    scale = torch.where(amax > 0, MAX[dtype] / amax, torch.ones_like(amax)).float()
    return (t.float() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype).double() / scale.double()


def _run(x, w, g, recipe):
    state = Fp8LinearState(recipe)
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fp8_linear(x, w, state)
    y.backward(g)
    return y, x.grad, w.grad


def _rel(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("wgrad", [True, False])
def test_every_gemm_uses_per_row_scales(fmt, wgrad):
    x = torch.randn(3, 5, 64, generator=_gen(0)) * torch.logspace(-2, 2, 64)  # columns of very different size
    w = torch.randn(48, 64, generator=_gen(1)) * 0.05
    g = torch.randn(3, 5, 48, generator=_gen(2))
    y, dx, dw = _run(x, w, g, Fp8Recipe(format=fmt, recipe="rowwise", wgrad=wgrad))
    bwd = E5M2 if fmt == "hybrid" else E4M3
    x2, g2 = x.reshape(-1, 64), g.reshape(-1, 48)
    # Equal to the emulation up to float32 accumulation (a wrong scale or axis is off by > 1e-2).
    # Forward: x per token, W per output feature.
    assert _rel(y.reshape(-1, 48), _rounded(x2, E4M3, 1) @ _rounded(w, E4M3, 1).t()) < 1e-6
    # Input gradient: dy per token, W per input feature.
    assert _rel(dx.reshape(-1, 64), _rounded(g2, bwd, 1) @ _rounded(w, E4M3, 0)) < 1e-6
    if wgrad:  # dy^T per output feature, x per input feature (both over the tokens)
        assert _rel(dw, _rounded(g2, bwd, 0).t() @ _rounded(x2, E4M3, 0)) < 1e-6
    else:
        torch.testing.assert_close(dw.double(), g2.double().t() @ x2.double(), rtol=1e-5, atol=1e-6)
    assert _rel(y, x.double() @ w.double().t()) < 0.06


def test_an_outlier_token_costs_precision_in_its_own_row_only():
    x = torch.randn(32, 64, generator=_gen(3))
    x[7] *= 1e6  # one token far larger than the others
    w = torch.randn(48, 64, generator=_gen(4)) * 0.05
    exact = x.double() @ w.double().t()
    others = [i for i in range(32) if i != 7]
    errors = {}
    for recipe in ("tensorwise", "rowwise"):
        y = fp8_linear(x, w, Fp8LinearState(Fp8Recipe(format="e4m3", recipe=recipe)))
        errors[recipe] = _rel(y[others], exact[others])
    # Tensorwise scales every token for the outlier: the others flush towards zero.
    assert errors["rowwise"] < 0.06 < 0.5 < errors["tensorwise"], errors


def test_config_and_refusals():
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=True)
    config = TransformerConfig(**base, fp8="hybrid", fp8_recipe="rowwise")
    assert Fp8Recipe.from_config(config).rowwise and not Fp8Recipe.from_config(config).delayed
    ddp = type("DDP", (), {"fp8_param_gather": True})()
    with pytest.raises(NotImplementedError, match=r"fp8_param_gather=True with fp8_recipe='rowwise' is not "
                                                  r"supported: a gathered weight carries one scale"):
        check_fp8_param_gather(config, ddp, True)
    with pytest.raises(ValueError, match=r"fp8_recipe must be one of \('tensorwise', 'delayed', 'rowwise'\)"):
        TransformerConfig(**base, fp8="hybrid", fp8_recipe="columnwise")


def test_a_torch_without_row_scales_is_named(monkeypatch):
    gemm.check_rowwise_support(torch.device("cpu"), torch.bfloat16, E4M3, E5M2)  # this torch has them on CPU
    monkeypatch.setattr(gemm, "_rowwise_error", lambda *args: "Invalid scaling configuration")
    with pytest.raises(NotImplementedError, match=r"fp8_recipe='rowwise' needs torch._scaled_mm with row scales on "
                                                  r"cpu for torch.float8_e4m3fn x torch.float8_e4m3fn -> "
                                                  r"torch.bfloat16, which torch .* does not have here \(Invalid "
                                                  r"scaling configuration\); supported here: "
                                                  r"fp8_recipe='tensorwise' or 'delayed'"):
        gemm.check_rowwise_support(torch.device("cpu"), torch.bfloat16, E4M3, E5M2)
