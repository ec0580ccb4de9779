"""Every Triton kernel compiles for an H100 (sm_90) in each of its constexpr variants, without a
GPU: Triton's compiler and ptxas run on the host. The interpreter tests (triton_testing.py)
check what the kernels compute but not that the compiler takes them; this catches a kernel that
would fail on its first GPU launch. Skipped where Triton is missing (the CPU build of torch), and
in a process that interprets the kernels."""

import itertools
import os

import pytest

pytest.importorskip("triton", reason="Triton is not installed (a CPU build of torch)")
if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels are then interpreted functions
    pytest.skip("TRITON_INTERPRET=1 in this process (conftest.py chooses it without a GPU): run this file "
                "with TRITON_INTERPRET=0, as scripts/cuda_build_check.sh does", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megatron_fsdp.fusions import triton_cross_entropy  # noqa: E402
from megatron_fsdp.models.common.embeddings import triton_rope  # noqa: E402
from megatron_fsdp.transformer import triton_activations, triton_bias_dropout_add  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)


def _rope(dtype, fused, backward):
    angles = "fp32" if fused else dtype
    signature = dict(x_ptr=f"*{dtype}", cos_ptr=f"*{angles}", sin_ptr=f"*{angles}", out_ptr=f"*{dtype}", n_rows="i64",
                     B="i32", H="i32", stride_s="i32", stride_b="i32", stride_h="i32", D="i32", ROT="i32")
    return triton_rope._rope_kernel, signature, dict(FUSED=fused, BACKWARD=backward, ROWS=32, BLOCK_D=128)


def _bda_fwd(dtype, has_bias, dropout):
    signature = dict(x_ptr=f"*{dtype}", bias_ptr=f"*{dtype}", residual_ptr=f"*{dtype}", seed_ptr="*i64",
                     out_ptr=f"*{dtype}", H="i32", p="fp32", scale="fp32")
    return triton_bias_dropout_add._bda_fwd_kernel, signature, dict(HAS_BIAS=has_bias, P=dropout, BLOCK=1024)


def _bda_bwd(dtype, dropout):
    signature = dict(g_ptr=f"*{dtype}", seed_ptr="*i64", dx_ptr="*fp32", H="i32", p="fp32", scale="fp32")
    return triton_bias_dropout_add._bda_bwd_kernel, signature, dict(P=dropout, BLOCK=1024)


def _bias_act(dtype, backward, kind, has_bias):
    constants = dict(KIND=kind, HAS_BIAS=has_bias, SQRT_2_OVER_PI=0.7978845608028654, CUBIC=0.044715,
                     CUBIC_GRAD=0.134145, BLOCK=1024)
    if backward:
        signature = dict(g_ptr=f"*{dtype}", y_ptr=f"*{dtype}", bias_ptr=f"*{dtype}", dy_ptr=f"*{dtype}", F="i32",
                         C="i32")
        return triton_activations._bias_act_bwd_kernel, signature, constants
    signature = dict(y_ptr=f"*{dtype}", bias_ptr=f"*{dtype}", out_ptr=f"*{dtype}", F="i32", C="i32")
    return triton_activations._bias_act_fwd_kernel, signature, constants


def _cross_entropy(dtype, backward):
    rows = dict(logits_ptr=f"*{dtype}", target_ptr="*i64", max_ptr="*fp32", sum_exp_ptr="*fp32")
    scalars = dict(V="i32", row_stride="i32", vocab_start="i32")
    if backward:
        signature = dict(**rows, grad_ptr="*fp32", dlogits_ptr=f"*{dtype}", **scalars)
        return triton_cross_entropy._ce_bwd_kernel, signature, dict(BLOCK=triton_cross_entropy._BLOCK)
    signature = dict(**rows, predicted_ptr="*fp32", row_stride="i32", vocab_start="i32")
    return triton_cross_entropy._ce_stats_kernel, signature, dict(V=128256, BLOCK=triton_cross_entropy._BLOCK)


CASES = ([_rope(*c) for c in itertools.product(("bf16", "fp16", "fp32"), (False, True), (False, True))]
         + [_bda_fwd(*c) for c in itertools.product(("bf16", "fp32"), (False, True), (False, True))]
         + [_bda_bwd(*c) for c in itertools.product(("bf16", "fp32"), (False, True))]
         + [_bias_act(*c) for c in itertools.product(("bf16",), (False, True), (0, 1, 2), (False, True))]
         + [_cross_entropy(*c) for c in itertools.product(("bf16", "fp16", "fp32"), (False, True))])


@pytest.mark.parametrize("kernel, signature, constants", CASES,
                         ids=[f"{k.__name__}-{sig[next(iter(sig))]}-{'-'.join(f'{n}={v}' for n, v in c.items() if n.isupper() and not isinstance(v, float))}"
                              for k, sig, c in CASES])
def test_kernel_compiles_for_sm90(kernel, signature, constants):
    signature = {**signature, **{name: "constexpr" for name in constants}}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants), target=H100)
    assert "sm_90" in compiled.asm["ptx"]
