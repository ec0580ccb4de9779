"""`MixedPrecisionPolicy`: NVIDIA Megatron-FSDP's mixed-precision argument of `fully_shard`.

The compute dtype is the model's own (build it in bf16 to compute in bf16);
the policy says in which dtype the optimizer's weights are kept and in which
dtype gradients are reduced. On FSDP2 (fully_shard.py) the sharded
parameters are the main weights: the model is cast to `main_params_dtype`
before sharding, and FSDP2 gathers them in the model's original dtype for
compute (its `MixedPrecisionPolicy(param_dtype=...)`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    main_params_dtype: Optional[torch.dtype] = torch.float32
    """The dtype of the sharded weights the optimizer updates (the main weights). None: the
    model's own dtype, no separate main weights."""

    main_grads_dtype: Optional[torch.dtype] = None
    """The dtype of the sharded gradients the optimizer reads. FSDP2 keeps a gradient in its
    parameter's dtype, so this must be None or equal to the main weights' dtype: both mean the
    main weights' dtype (NVIDIA's None means the compute dtype; gradients kept in fp32 cost
    more memory and lose nothing)."""

    grad_comm_dtype: Optional[torch.dtype] = None
    """The dtype gradients are reduced (reduce-scattered or all-reduced) in. None: the main
    gradients' dtype."""

    def __post_init__(self):
        for name in ("main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                raise ValueError(f"MixedPrecisionPolicy.{name} must be None or a floating-point dtype "
                                 f"({', '.join(str(d) for d in _FLOATS)}), got {value!r}")
        if self.main_grads_dtype is not None and self.main_grads_dtype != self.main_params_dtype:
            raise ValueError(
                f"MixedPrecisionPolicy.main_grads_dtype={self.main_grads_dtype} differs from "
                f"main_params_dtype={self.main_params_dtype}: FSDP2 keeps each gradient in its parameter's "
                "dtype; leave main_grads_dtype None (or set it to main_params_dtype) and choose the "
                "reduction dtype with grad_comm_dtype")
