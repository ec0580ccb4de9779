"""AdamW / SGD over sharded parameters, behind Megatron-Core's optimizer API.

`get_megatron_optimizer(config, model_chunks)` returns a `MegatronOptimizer`
whose `step()` clips by the global gradient norm (every element counted once
across TP and DP) and returns `(update_successful, grad_norm, num_zeros_in_grad)`
as Megatron's does. Biases and norm weights (1-D parameters) get no weight
decay, as in Megatron. With FSDP the parameters, gradients and optimizer
states are all shards: the optimizer is distributed by construction.

With `config.bf16`, every bf16 parameter gets an fp32 main copy that the torch
optimizer steps and that is copied back into the model after each step
(Megatron's Float16OptimizerWithFloat16Params). fp32 parameters, such as the
sharded master weights FSDP keeps under mixed precision, are stepped directly.
Every trainable parameter must be fp32 or `config.params_dtype` (the dtype
the model was built in, bf16 under Megatron's --bf16).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..model_parallel_config import reject_unsupported
from .clip_grads import clip_grad_norm_, count_zeros_fp32, get_grad_norm_fp32

_PARAMS_DTYPES = (torch.float32, torch.bfloat16)


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
        if self.params_dtype not in _PARAMS_DTYPES:
            raise ValueError(f"params_dtype must be one of {list(_PARAMS_DTYPES)} (fp16 needs a loss scaler, "
                             f"which megatron_fsdp does not provide), got {self.params_dtype!r}")


def _fused_or_foreach(params: list[torch.Tensor]) -> dict:
    # The fused kernels cover CUDA (and CPU since torch 2.4) plain and DTensor
    # parameters of one floating dtype; otherwise the foreach path runs.
    dtypes = {p.dtype for p in params}
    if params and len(dtypes) == 1 and all(p.device.type in ("cuda", "cpu") for p in params):
        return {"fused": True}
    return {"foreach": True}


class MegatronOptimizer:
    """A torch optimizer plus Megatron's step protocol.

    `params` are the model's trainable parameters; `main_params` (same order)
    are what the torch optimizer steps: the parameter itself, or its fp32
    main copy.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, params: list[nn.Parameter],
                 main_params: Optional[list[nn.Parameter]] = None):
        main_params = list(params) if main_params is None else list(main_params)
        if len(main_params) != len(params):
            raise ValueError(f"main_params has {len(main_params)} entries for {len(params)} params")
        self.optimizer = optimizer
        self.config = config
        self._params = list(params)
        self._main_params = main_params
        self._float16_pairs = [(p, m) for p, m in zip(params, main_params) if m is not p]
        self._main_of = {id(p): m for p, m in self._float16_pairs}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def has_main_params(self) -> bool:
        return bool(self._float16_pairs)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Move the model's bf16 gradients into the fp32 main gradients.
        Returns whether an inf/nan was found (never: bf16 needs no loss scale)."""
        for model_param, main_param in self._float16_pairs:
            if model_param.grad is not None:
                main_param.grad = model_param.grad.float()
                model_param.grad = None  # the fp32 copy is the one used from here on
        return False

    def get_grad_norm(self) -> float:
        self.prepare_grads()
        return get_grad_norm_fp32([p.grad for p in self._main_params if p.grad is not None])

    def count_zeros(self) -> int:
        self.prepare_grads()
        return count_zeros_fp32(self._main_params)

    @torch.no_grad()
    def step(self) -> tuple[bool, float, Optional[int]]:
        self.prepare_grads()
        if self.config.clip_grad > 0:
            grad_norm = clip_grad_norm_(self._main_params, self.config.clip_grad)
        else:
            grad_norm = self.get_grad_norm()
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        for model_param, main_param in self._float16_pairs:
            model_param.copy_(main_param)
        return True, grad_norm, num_zeros

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model's, after the model's
        weights were changed outside the optimizer (a checkpoint loaded
        without optimizer state, for instance)."""
        for model_param, main_param in self._float16_pairs:
            main_param.copy_(model_param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for model_param, _ in self._float16_pairs:
            if model_param.grad is not None:
                if set_to_none:
                    model_param.grad = None
                else:
                    model_param.grad.zero_()

    def main_params_module(self, model: nn.Module) -> nn.Module:
        """The module whose parameters are the ones this optimizer steps,
        under the names `model` gives them: `model` itself, or a mirror of its
        parameter names holding the fp32 main params. torch.distributed.checkpoint
        maps optimizer state to names through it, so the keys are the same
        with and without main params."""
        if not self._float16_pairs:
            return model
        mirror = nn.Module()
        for name, param in model.named_parameters(remove_duplicate=False):
            *path, leaf = name.split(".")
            module = mirror
            for part in path:
                if part not in module._modules:
                    module.add_module(part, nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, self._main_of.get(id(param), param))
        return mirror

    def main_params_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The fp32 main params by `model`'s parameter names (empty without
        main params); loading into these tensors restores them in place."""
        return {name: self._main_of[id(p)].detach() for name, p in model.named_parameters()
                if id(p) in self._main_of}

    def state_dict(self):
        if not self._float16_pairs:
            return self.optimizer.state_dict()
        mains = {id(m) for _, m in self._float16_pairs}
        # Megatron's Float16OptimizerWithFloat16Params layout.
        return {"optimizer": self.optimizer.state_dict(),
                "fp32_from_fp16_params": [[p for p in g["params"] if id(p) in mains] for g in self.param_groups]}

    def load_state_dict(self, state_dict) -> None:
        if not self._float16_pairs:
            self.optimizer.load_state_dict(state_dict)
            return
        if "fp32_from_fp16_params" not in state_dict:
            raise ValueError("this optimizer keeps fp32 main params (bf16=True): its state dict needs "
                             "'optimizer' and 'fp32_from_fp16_params' entries, got keys "
                             f"{sorted(state_dict)}")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        mains = {id(m) for _, m in self._float16_pairs}
        with torch.no_grad():
            for group, saved in zip(self.param_groups, state_dict["fp32_from_fp16_params"]):
                current = [p for p in group["params"] if id(p) in mains]
                if len(current) != len(saved):
                    raise ValueError(f"fp32_from_fp16_params has {len(saved)} params for a group of "
                                     f"{len(current)}")
                for p, value in zip(current, saved):
                    p.copy_(value)


def _main_param(name: str, param: nn.Parameter, config: OptimizerConfig) -> nn.Parameter:
    if param.dtype not in (torch.float32, config.params_dtype):
        raise ValueError(
            f"parameter {name} is {param.dtype}, but OptimizerConfig.params_dtype={config.params_dtype}: "
            f"parameters must be float32 or params_dtype (set params_dtype to the dtype the model was built "
            f"in, and bf16=True for fp32 main params)")
    if config.bf16 and param.dtype == torch.bfloat16:
        return nn.Parameter(param.detach().clone().float())
    return param


def get_megatron_optimizer(config: OptimizerConfig, model_chunks) -> MegatronOptimizer:
    """AdamW (or SGD) over `model_chunks` (a module or a list of them)."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    params, mains = [], []
    # Keyed (no weight decay, plain tensor): the fused and foreach kernels
    # take a group's tensors in one call, which cannot mix DTensors with
    # plain tensors (TP weights beside replicated norm weights without FSDP).
    by_group: dict[tuple[bool, bool], list] = {(no_decay, plain): [] for no_decay in (False, True)
                                               for plain in (False, True)}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                main = _main_param(name, p, config)
                params.append(p)
                mains.append(main)
                by_group[(p.dim() == 1 or name.endswith(".bias"), not isinstance(main, DTensor))].append(main)
    if not params:
        raise ValueError("get_megatron_optimizer: the model has no trainable parameters")
    groups = [{"params": group, "weight_decay": 0.0 if no_decay else config.weight_decay}
              for (no_decay, _), group in by_group.items() if group]
    if config.optimizer == "adam":
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                      eps=config.adam_eps, **_fused_or_foreach(mains))
    else:
        optimizer = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, foreach=True)
    return MegatronOptimizer(optimizer, config, params, mains)
