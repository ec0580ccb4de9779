"""AdamW / SGD over sharded parameters, behind Megatron-Core's optimizer API.

`get_megatron_optimizer(config, model_chunks)` returns a `MegatronOptimizer`
whose `step()` clips by the global gradient norm (every element counted once
across TP and DP) and returns `(update_successful, grad_norm, num_zeros_in_grad)`
as Megatron's does. Biases and norm weights (1-D parameters) get no weight
decay, as in Megatron. With FSDP the parameters, gradients and optimizer
states are all shards: the optimizer is distributed by construction.

With `config.bf16` (`config.fp16`), every bf16 (fp16) parameter gets an fp32
main copy that the torch optimizer steps and that is copied back into the
model after each step (Megatron's Float16OptimizerWithFloat16Params). fp32
parameters, such as the sharded master weights FSDP keeps under mixed
precision, are stepped directly. Every trainable parameter must be fp32 or
`config.params_dtype` (the dtype the model was built in).

fp16 needs a loss scale (grad_scaler.py): `scale_loss(loss)` before backward,
and `step()` unscales the fp32 gradients, agrees with every rank on whether
any of them overflowed, and on overflow skips the update and returns
`(False, None, None)`, as Megatron does. The scaler's state is part of
`state_dict()`.

Post-step hooks: `step()` ends with every hook registered on it
(`register_step_post_hook`); get_megatron_optimizer registers those the
model chunks carry (`megatron_fsdp.utils.register_post_step_hook`: the fp8
converter's scale refresh, say), so a Megatron-style loop needs no change.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .. import _torch_compat
from ..utils import is_distributed, post_step_hooks
from .clip_grads import clip_grad_norm_, count_zeros_fp32, get_grad_norm_fp32
from .grad_scaler import MegatronGradScaler, build_grad_scaler

logger = logging.getLogger(__name__)

_PARAMS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    initial_loss_scale: float = 2 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    log_num_zeros_in_grad: bool = False
    # The optimizer steps on the CPU, where FSDP2's CPU offload keeps the sharded parameters,
    # gradients and optimizer state (the model wrapped with cpu_offload=True; --optimizer-cpu-offload).
    optimizer_cpu_offload: bool = False

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.lr is None or self.lr <= 0:
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if not isinstance(self.optimizer_cpu_offload, bool):
            raise ValueError(f"optimizer_cpu_offload must be True or False, got {self.optimizer_cpu_offload!r}")
        if self.params_dtype not in _PARAMS_DTYPES:
            raise ValueError(f"params_dtype must be one of {list(_PARAMS_DTYPES)}, got {self.params_dtype!r}")
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16 and bf16 cannot both be True")
        if self.params_dtype == torch.float16 and not self.fp16:
            raise ValueError("params_dtype=torch.float16 needs fp16=True: fp16 training needs a loss scaler")
        if self.params_dtype == torch.bfloat16 and self.fp16:
            raise ValueError("params_dtype=torch.bfloat16 does not go with fp16=True (use bf16=True)")
        if self.loss_scale is not None:
            if isinstance(self.loss_scale, bool) or not self.loss_scale > 0:
                raise ValueError(f"loss_scale must be a positive number (a constant scale) or None (dynamic "
                                 f"scaling under fp16), got {self.loss_scale!r}")
            if not (self.fp16 or self.bf16):
                raise ValueError(f"loss_scale={self.loss_scale} needs fp16=True or bf16=True: fp32 training "
                                 "does not scale the loss")
        if self.fp16 and self.loss_scale is None:
            # Checked here so a bad flag fails before the model is touched.
            build_grad_scaler(True, None, self.initial_loss_scale, self.min_loss_scale, self.loss_scale_window,
                              self.hysteresis, device="cpu")


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
    main copy. `grad_scaler` (Megatron's attribute) scales the loss for fp16,
    or None. `post_step_hooks`: callables step() runs at its end, taken or
    skipped (every rank takes the same branch); more with register_step_post_hook.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, params: list[nn.Parameter],
                 main_params: Optional[list[nn.Parameter]] = None,
                 grad_scaler: Optional[MegatronGradScaler] = None,
                 post_step_hooks: Optional[list[Callable[[], None]]] = None):
        main_params = list(params) if main_params is None else list(main_params)
        if len(main_params) != len(params):
            raise ValueError(f"main_params has {len(main_params)} entries for {len(params)} params")
        if config.fp16 and grad_scaler is None:
            raise ValueError("OptimizerConfig(fp16=True) needs a grad_scaler: fp16 gradients underflow "
                             "without a loss scale (get_megatron_optimizer builds one)")
        self.optimizer = optimizer
        self.config = config
        self.grad_scaler = grad_scaler
        self._params = list(params)
        self._main_params = main_params
        self._float16_pairs = [(p, m) for p, m in zip(params, main_params) if m is not p]
        self._main_of = {id(p): m for p, m in self._float16_pairs}
        self._scale_one = None
        self._post_step_hooks = list(post_step_hooks or [])

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def has_main_params(self) -> bool:
        return bool(self._float16_pairs)

    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale, a one-element float32 tensor (1.0 without a scaler)."""
        if self.grad_scaler is not None:
            return self.grad_scaler.scale
        if self._scale_one is None:
            device = self._main_params[0].device if self._main_params else torch.device("cpu")
            self._scale_one = torch.ones(1, dtype=torch.float32, device=device)
        return self._scale_one

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the loss scale: call backward on this under fp16."""
        return self.get_loss_scale().to(loss.device) * loss

    @torch.no_grad()
    def _copy_model_grads_to_main_grads(self) -> None:
        for model_param, main_param in self._float16_pairs:
            if model_param.grad is not None:
                main_param.grad = model_param.grad.float()
                model_param.grad = None  # the fp32 copy is the one used from here on

    @torch.no_grad()
    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """Multiply every main gradient by 1/scale; True when any rank holds
        an inf or NaN. Every rank joins the one all-reduce, grads or not."""
        by_device_dtype: dict[tuple, list[torch.Tensor]] = {}
        for p in self._main_params:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                by_device_dtype.setdefault((local.device, local.dtype), []).append(local)
        scaler_device = self.grad_scaler.scale.device
        found_inf = torch.zeros(1, dtype=torch.float32, device=scaler_device)
        inv_scale = self.grad_scaler.inv_scale
        for (device, _), grads in by_device_dtype.items():
            found_here = torch.zeros(1, dtype=torch.float32, device=device)
            _torch_compat.amp_non_finite_check_and_unscale_(grads, found_here, inv_scale.to(device))
            found_inf += found_here.to(scaler_device)
        if is_distributed():
            # The whole world: with FSDP every rank holds different shards, and
            # a skip must be unanimous or the ranks' weights drift apart.
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.get_grad_stats_parallel_group())
        return bool(found_inf.item() > 0)

    def get_grad_stats_parallel_group(self):
        """The group over which the overflow flag is reduced: None, the world."""
        return None

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Move model gradients into the fp32 main gradients, unscale them and
        update the loss scale; returns whether an inf/NaN was found on any rank."""
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        found_inf = self._unscale_main_grads_and_check_for_nan()
        self.grad_scaler.update(found_inf)
        return found_inf

    def get_grad_norm(self) -> float:
        self._copy_model_grads_to_main_grads()
        return get_grad_norm_fp32([p.grad for p in self._main_params if p.grad is not None])

    def count_zeros(self) -> int:
        self._copy_model_grads_to_main_grads()
        return count_zeros_fp32(self._main_params)

    @torch.no_grad()
    def step(self) -> tuple[bool, Optional[float], Optional[int]]:
        """Returns (update_successful, grad_norm, num_zeros_in_grad);
        (False, None, None) when the step was skipped for an overflow. The
        post-step hooks run either way (every rank takes the same branch)."""
        if self.prepare_grads():
            self._run_post_step_hooks()
            return False, None, None
        if self.config.clip_grad > 0:
            grad_norm = clip_grad_norm_(self._main_params, self.config.clip_grad)
        else:
            grad_norm = self.get_grad_norm()
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        for model_param, main_param in self._float16_pairs:
            model_param.copy_(main_param)
        self._run_post_step_hooks()
        return True, grad_norm, num_zeros

    def register_step_post_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook()` at the end of every step()."""
        self._post_step_hooks.append(hook)

    def _run_post_step_hooks(self) -> None:
        for hook in self._post_step_hooks:
            hook()

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
                children = dict(module.named_children())
                if part not in children:
                    module.add_module(part, children.setdefault(part, nn.Module()))
                module = children[part]
            module.register_parameter(leaf, self._main_of.get(id(param), param))
        return mirror

    def main_params_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The fp32 main params by `model`'s parameter names (empty without
        main params); loading into these tensors restores them in place."""
        return {name: self._main_of[id(p)].detach() for name, p in model.named_parameters()
                if id(p) in self._main_of}

    def state_dict(self):
        """The torch optimizer's state dict when there is nothing else to
        keep; otherwise Megatron's Float16Optimizer layout: 'optimizer',
        'grad_scaler' (with a scaler), 'fp32_from_fp16_params' (with main params)."""
        if not self._float16_pairs and self.grad_scaler is None:
            return self.optimizer.state_dict()
        state = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        if self._float16_pairs:
            mains = {id(m) for _, m in self._float16_pairs}
            state["fp32_from_fp16_params"] = [[p for p in g["params"] if id(p) in mains]
                                              for g in self.param_groups]
        return state

    def load_state_dict(self, state_dict) -> None:
        nested = "optimizer" in state_dict and "param_groups" not in state_dict
        if self._float16_pairs and "fp32_from_fp16_params" not in state_dict:
            raise ValueError("this optimizer keeps fp32 main params (bf16/fp16=True): its state dict needs "
                             "'optimizer' and 'fp32_from_fp16_params' entries, got keys "
                             f"{sorted(state_dict)}")
        self.optimizer.load_state_dict(state_dict["optimizer"] if nested else state_dict)
        if self.grad_scaler is not None:
            if nested and "grad_scaler" in state_dict:
                self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
            else:
                logger.warning("optimizer state dict holds no loss-scaler state: keeping the current loss "
                               "scale %s", float(self.grad_scaler.scale))
        if not self._float16_pairs:
            return
        mains = {id(m) for _, m in self._float16_pairs}
        with torch.no_grad():
            for group, saved in zip(self.param_groups, state_dict["fp32_from_fp16_params"]):
                current = [p for p in group["params"] if id(p) in mains]
                if len(current) != len(saved):
                    raise ValueError(f"fp32_from_fp16_params has {len(saved)} params for a group of "
                                     f"{len(current)}")
                for p, value in zip(current, saved):
                    p.copy_(value)


_FP16_HINT = ("fp16 training needs a loss scaler: pass OptimizerConfig(fp16=True) (dynamic scaling, or "
              "loss_scale=<constant>)")


def _main_param(name: str, param: nn.Parameter, config: OptimizerConfig) -> nn.Parameter:
    if param.dtype == torch.float16 and not config.fp16:
        raise ValueError(f"parameter {name} is torch.float16 but OptimizerConfig.fp16=False: {_FP16_HINT}")
    if param.dtype == torch.bfloat16 and config.fp16:
        raise ValueError(f"parameter {name} is torch.bfloat16 but OptimizerConfig.fp16=True: use bf16=True")
    if param.dtype not in (torch.float32, config.params_dtype):
        raise ValueError(
            f"parameter {name} is {param.dtype}, but OptimizerConfig.params_dtype={config.params_dtype}: "
            f"parameters must be float32 or params_dtype (set params_dtype to the dtype the model was built "
            f"in, and bf16=True / fp16=True for fp32 main params)")
    if (config.bf16 and param.dtype == torch.bfloat16) or (config.fp16 and param.dtype == torch.float16):
        return nn.Parameter(param.detach().clone().float())
    return param


def _check_model_precision(config: OptimizerConfig, chunks) -> None:
    """A model whose config says it computes in fp16 (the FSDP wrapper then
    gathers fp16 weights) needs a loss scaler, and an fp16 optimizer needs a
    model that computes in fp16."""
    for i, chunk in enumerate(chunks):
        model_config = getattr(chunk, "config", None)
        if model_config is None or not hasattr(model_config, "fp16"):
            continue  # a plain module: its parameter dtypes are checked instead
        if model_config.fp16 and not config.fp16:
            raise ValueError(f"model chunk {i} ({type(chunk).__name__}) has config.fp16=True but "
                             f"OptimizerConfig.fp16=False: {_FP16_HINT}")
        if config.fp16 and not model_config.fp16:
            raise ValueError(f"OptimizerConfig.fp16=True but model chunk {i} ({type(chunk).__name__}) has "
                             f"config.fp16=False (bf16={getattr(model_config, 'bf16', False)}): set "
                             "TransformerConfig(fp16=True) so the model computes in fp16, or drop fp16 from "
                             "the optimizer")


def _check_cpu_offload(config: OptimizerConfig, chunks) -> None:
    """optimizer_cpu_offload steps the optimizer where FSDP2's CPU offload keeps the sharded
    parameters and gradients: the model must be wrapped so, and the optimizer must know."""
    for i, chunk in enumerate(chunks):
        offloaded = bool(getattr(chunk, "cpu_offload", False))
        if config.optimizer_cpu_offload and not offloaded:
            raise ValueError(f"OptimizerConfig.optimizer_cpu_offload=True but model chunk {i} "
                             f"({type(chunk).__name__}) is not wrapped with CPU offload: wrap it with "
                             "TorchFullyShardedDataParallel and TorchFullyShardedDataParallelConfig(cpu_offload=True)")
        if offloaded and not config.optimizer_cpu_offload:
            raise ValueError(f"model chunk {i} ({type(chunk).__name__}) is wrapped with CPU offload: set "
                             "OptimizerConfig(optimizer_cpu_offload=True) (--optimizer-cpu-offload)")


def get_megatron_optimizer(config: OptimizerConfig, model_chunks) -> MegatronOptimizer:
    """AdamW (or SGD) over `model_chunks` (a module or a list of them).

    Decayed groups get `wd_mult` 1 and biases / norm weights `wd_mult` 0, for
    OptimizerParamScheduler's weight-decay schedule. With fp16 (or a
    `loss_scale`) the optimizer carries Megatron's grad scaler.
    """
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    _check_model_precision(config, chunks)
    _check_cpu_offload(config, chunks)
    params, mains = [], []
    # Keyed (no weight decay, plain tensor, expert): the fused and foreach kernels
    # take a group's tensors in one call, which cannot mix DTensors with
    # plain tensors (TP weights beside replicated norm weights without FSDP),
    # nor DTensors of the experts' mesh with the dense layers'.
    by_group: dict[tuple[bool, bool, bool], list] = {(no_decay, plain, expert): [] for expert in (False, True)
                                                     for no_decay in (False, True) for plain in (False, True)}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                main = _main_param(name, p, config)
                params.append(p)
                mains.append(main)
                expert = getattr(p, "allreduce", True) is False  # Megatron's expert marker
                by_group[(p.dim() == 1 or name.endswith(".bias"), not isinstance(main, DTensor), expert)].append(main)
    if not params:
        raise ValueError("get_megatron_optimizer: the model has no trainable parameters")
    groups = [{"params": group, "weight_decay": 0.0 if no_decay else config.weight_decay,
               "wd_mult": 0.0 if no_decay else 1.0}
              for (no_decay, _, _), group in by_group.items() if group]
    if config.optimizer == "adam":
        optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                      eps=config.adam_eps, **_fused_or_foreach(mains))
    else:
        optimizer = torch.optim.SGD(groups, lr=config.lr, momentum=config.sgd_momentum, foreach=True)
    wd_mults = [g["wd_mult"] for g in optimizer.param_groups]

    def _keep_wd_mult(opt) -> None:
        # torch's load_state_dict takes the saved groups' keys; checkpoints
        # written before wd_mult existed would leave no-decay groups decaying.
        for group, mult in zip(opt.param_groups, wd_mults):
            group.setdefault("wd_mult", mult)

    optimizer.register_load_state_dict_post_hook(_keep_wd_mult)
    grad_scaler = build_grad_scaler(config.fp16, config.loss_scale, config.initial_loss_scale,
                                    config.min_loss_scale, config.loss_scale_window, config.hysteresis,
                                    device=mains[0].device)
    return MegatronOptimizer(optimizer, config, params, mains, grad_scaler=grad_scaler,
                             post_step_hooks=post_step_hooks(chunks))
