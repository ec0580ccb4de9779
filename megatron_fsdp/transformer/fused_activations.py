"""The activations Megatron-Core runs with `bias_activation_fusion=True`.

Megatron's fused paths are not its unfused ones with fewer kernels:
- GELU and GeGLU use the tanh approximation of GELU, with Megatron's
  constants (0.79788456 for sqrt(2/pi), 0.1070322243 for its derivative term),
  where the unfused path calls the exact `F.gelu`;
- the bias add, the activation and the gating run as one compiled kernel
  (`torch.compile`, Megatron's `jit_fuser`), which computes in fp32 and
  rounds to the input dtype once; the unfused path rounds after every op.
Backward uses Megatron's closed-form derivatives, also in fp32, rounded once,
and keeps only the inputs for it.

Gated inputs hold Megatron-Core's fc1 layout: the gate, then the up
projection, in halves of the last dimension (see MLP).

On CUDA, forward and backward are one Triton kernel each
(triton_activations.py: the same formulas, per element, in fp32); the eager
code below runs elsewhere (the CPU) and is the kernels' test reference.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .gelu_constants import CUBIC as _CUBIC, CUBIC_GRAD as _CUBIC_GRAD, SQRT_2_OVER_PI as _SQRT_2_OVER_PI
from ..utils import triton_kernels_for

KINDS = ("gelu", "geglu", "swiglu")


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron's fused GELU formula (the tanh approximation)."""
    return x * 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1 + _CUBIC * x * x)))


def _tanh_gelu_and_grad(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tanh_out = torch.tanh(_SQRT_2_OVER_PI * x * (1 + _CUBIC * x * x))
    grad = 0.5 * x * ((1 - tanh_out * tanh_out) * (_SQRT_2_OVER_PI + _CUBIC_GRAD * x * x)) + 0.5 * (1 + tanh_out)
    return x * 0.5 * (1.0 + tanh_out), grad


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = torch.chunk(x, 2, dim=-1)
    return gate, up


def _join(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat((gate, up), dim=-1)


def _biased_fp32(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    x = y.float()
    return x + bias.float() if bias is not None else x


def _forward_fp32(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return tanh_gelu(x)
    gate, up = _split(x)
    return (tanh_gelu(gate) if kind == "geglu" else F.silu(gate)) * up


def _backward_fp32(g: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return _tanh_gelu_and_grad(x)[1] * g
    gate, up = _split(x)
    if kind == "geglu":
        activated, grad = _tanh_gelu_and_grad(gate)
        return _join((g * up) * grad, g * activated)
    sig = torch.sigmoid(gate)
    return _join(g * sig * (1 + gate * (1 - sig)) * up, g * F.silu(gate))


def _kernels_for(y: torch.Tensor):
    """triton_activations for a CUDA tensor when Triton is there, else None (the eager path)."""
    return triton_kernels_for(y, "megatron_fsdp.transformer.triton_activations")


class BiasActivationFunction(torch.autograd.Function):
    """act(y + bias) as Megatron's fused bias-GELU / bias-GeGLU / bias-SwiGLU compute it."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
        ctx.save_for_backward(y, bias)
        ctx.kind = kind
        kernels = _kernels_for(y)
        if kernels is not None:
            return kernels.bias_act_fwd(y, bias, kernels.CODES[kind])
        return _forward_fp32(_biased_fp32(y, bias), kind).to(y.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        y, bias = ctx.saved_tensors
        kernels = _kernels_for(y)
        if kernels is not None:
            grad = kernels.bias_act_bwd(grad_output, y, bias, kernels.CODES[ctx.kind])
        else:
            grad = _backward_fp32(grad_output.float(), _biased_fp32(y, bias), ctx.kind).to(y.dtype)
        # Megatron returns the same tensor for the bias and autograd sums it over the tokens.
        grad_bias = None
        if bias is not None and ctx.needs_input_grad[1]:
            grad_bias = grad.sum(dim=tuple(range(grad.dim() - 1))).to(bias.dtype)
        return grad, grad_bias, None


def bias_activation(y: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    if kind not in KINDS:
        raise ValueError(f"bias_activation: kind={kind!r}, allowed: {KINDS}")
    return BiasActivationFunction.apply(y, bias, kind)


def weighted_swiglu(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Megatron's fused token-weighted SwiGLU: (silu(gate) * up * weights) in fp32, rounded once."""
    gate, up = _split(y.float())
    return (F.silu(gate) * up * weights).to(y.dtype)
