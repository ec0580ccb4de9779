"""What the Triton kernel tests share: where the kernels run, and how close a kernel that rounds
an fp32 value once must come to the eager path.

On a GPU the kernels run as CUDA kernels. Without one (a CUDA build of torch with Triton, as
scripts/cuda_build_check.sh runs them) Triton's interpreter runs the same kernels on CPU tensors:
the indexing, masking and arithmetic are the kernels', only the compiler is not (and it rounds
fp32 -> bf16/fp16 toward zero). Importing this module skips the importing test module where
Triton is missing (the CPU build of torch); import it before the kernels' modules.
"""

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # conftest.py sets it first, before Triton is imported
pytest.importorskip("triton", reason="Triton is not installed (a CPU build of torch)")

DEVICE = "cuda" if ON_GPU else "cpu"
# The same fp32 value rounded once (the compiler may contract a product and a sum into one fma):
# an ulp of the dtype at most.
ONE_ULP = {torch.float32: dict(rtol=3e-7, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=1e-5),
           torch.float16: dict(rtol=1e-3, atol=1e-5)}


def assert_compiled_equals_eager(fn, inputs, *args, grad_out=None) -> None:
    """fn(*inputs, *args) compiled whole (fullgraph) gives eager's output and eager's gradients of
    `inputs` bit for bit, for `grad_out` (ones when None) as the output's gradient."""
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        out = f(*xs, *args)
        out.backward(torch.ones_like(out) if grad_out is None else grad_out)
        results.append((out, *(x.grad for x in xs)))
    for eager, compiled in zip(*results):
        assert torch.equal(compiled, eager)
