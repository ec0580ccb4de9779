"""LayerNorm and RMSNorm whose weights know about tensor parallelism.

Norm weights are replicated over TP ranks. When each rank normalizes only part
of the data (a sequence-parallel shard of the tokens, or its own attention
heads for QK-norm) each rank holds only part of the weight gradient, and the
parts are summed over the TP group in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state
from ..tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from ..tensor_parallel.reset import ResetsDeclaredParameters
from ..tensor_parallel.utils import constant_init, local_tensor, record_init


class _Norm(ResetsDeclaredParameters, nn.Module):
    def __init__(self, config, hidden_size: int, eps: float, *, partial_grads: bool, bias: bool):
        super().__init__()
        device = None if torch.empty(0).device.type == "meta" else parallel_state.get_device()
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.partial_grads = partial_grads
        fill = 0.0 if self.zero_centered_gamma else 1.0
        self.weight = nn.Parameter(torch.full((hidden_size,), fill, dtype=config.params_dtype, device=device))
        record_init(self, "weight", constant_init(fill), config)
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=device))
            record_init(self, "bias", constant_init(0.0), config)
        else:
            self.register_parameter("bias", None)

    def _param(self, p):
        if p is None:
            return None
        p = local_tensor(p)
        return copy_to_tensor_model_parallel_region(p) if self.partial_grads else p

    def _weight(self):
        weight = self._param(self.weight)
        return weight + 1 if self.zero_centered_gamma else weight

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class LayerNorm(_Norm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, partial_grads: bool = False):
        super().__init__(config, hidden_size, eps, partial_grads=partial_grads, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self._weight(), self._param(self.bias), self.eps)


class RMSNorm(_Norm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, *, partial_grads: bool = False):
        super().__init__(config, hidden_size, eps, partial_grads=partial_grads, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self._weight(), self.eps)


def build_norm(config, hidden_size: int, eps: float | None = None, *, partial_grads: bool) -> _Norm:
    cls = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[config.normalization]
    return cls(config, hidden_size, config.layernorm_epsilon if eps is None else eps,
               partial_grads=partial_grads)
