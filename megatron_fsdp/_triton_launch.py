"""What every Triton kernel module here shares for its launches (importing it needs Triton)."""

from __future__ import annotations

from torch.library import wrap_triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction


def traceable(kernel):
    """wrap_triton(kernel), so that torch.compile traces the launch. Under Triton's interpreter
    (TRITON_INTERPRET=1) `triton.jit` makes an InterpretedFunction instead, which torch 2.11's
    wrap_triton refuses and later torch hands back unwrapped: here too it runs as it is."""
    return wrap_triton(kernel) if isinstance(kernel, (JITFunction, Autotuner)) else kernel
