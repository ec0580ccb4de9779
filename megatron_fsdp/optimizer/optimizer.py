"""AdamW / SGD over sharded parameters, behind Megatron-Core's optimizer API.

`get_megatron_optimizer(config, model_chunks)` returns a `MegatronOptimizer`
whose `step()` clips by the global gradient norm (every element counted once
across TP and DP) and returns `(update_successful, grad_norm, num_zeros_in_grad)`
as Megatron's does. Biases and norm weights (1-D parameters) get no weight
decay, as in Megatron. With FSDP the parameters, gradients and optimizer
states are all shards: the optimizer is distributed by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from ..model_parallel_config import reject_unsupported
from .clip_grads import clip_grad_norm_, get_grad_norm_fp32


@dataclasses.dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    lr: Optional[float] = None
    min_lr: Optional[float] = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    params_dtype: torch.dtype = torch.float32
    use_distributed_optimizer: bool = False
    loss_scale: Optional[float] = None
    log_num_zeros_in_grad: bool = False
    optimizer_cpu_offload: bool = False

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.lr is None or self.lr <= 0:
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        # fp16 needs a loss scaler; megatron_fsdp trains in bf16 or fp32.
        reject_unsupported(self, {"fp16": False, "loss_scale": None, "optimizer_cpu_offload": False})


def _fused_or_foreach(params: list[torch.Tensor]) -> dict:
    # The fused kernels cover CUDA (and CPU since torch 2.4) plain and DTensor
    # parameters of one floating dtype; otherwise the foreach path runs.
    dtypes = {p.dtype for p in params}
    if params and len(dtypes) == 1 and all(p.device.type in ("cuda", "cpu") for p in params):
        return {"fused": True}
    return {"foreach": True}


class MegatronOptimizer:
    """A torch optimizer plus Megatron's step protocol."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, params: list[nn.Parameter]):
        self.optimizer = optimizer
        self.config = config
        self._params = params

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def get_grad_norm(self) -> float:
        return get_grad_norm_fp32([p.grad for p in self._params if p.grad is not None])

    @torch.no_grad()
    def step(self) -> tuple[bool, float, Optional[int]]:
        if self.config.clip_grad > 0:
            grad_norm = clip_grad_norm_(self._params, self.config.clip_grad)
        else:
            grad_norm = self.get_grad_norm()
        num_zeros = None
        if self.config.log_num_zeros_in_grad:
            num_zeros = int(sum((p.grad == 0).sum().item() for p in self._params if p.grad is not None))
        self.optimizer.step()
        return True, grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)


def get_megatron_optimizer(config: OptimizerConfig, model_chunks) -> MegatronOptimizer:
    """AdamW (or SGD) over `model_chunks` (a module or a list of them)."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    decay, no_decay = [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                (no_decay if p.dim() == 1 or name.endswith(".bias") else decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": config.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    params = decay + no_decay
    if not params:
        raise ValueError("get_megatron_optimizer: the model has no trainable parameters")
    if config.optimizer == "adam":
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                      eps=config.adam_eps, **_fused_or_foreach(params))
    else:
        optimizer = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, foreach=True)
    return MegatronOptimizer(optimizer, config, params)
