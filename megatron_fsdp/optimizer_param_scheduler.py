"""OptimizerParamScheduler: Megatron-Core's learning-rate and weight-decay schedule.

Learning rate: linear warmup from init_lr to max_lr over lr_warmup_steps, then
decay to min_lr by lr_decay_steps in one of Megatron's styles (constant,
linear, cosine, inverse-square-root, WSD), min_lr after that.

Weight decay: from start_wd to end_wd over wd_incr_steps (constant, linear or
cosine), then end_wd. Each param group gets that value times its `wd_mult`
(get_megatron_optimizer gives biases and norm weights wd_mult 0), so groups
without weight decay keep none.

A group's own `max_lr` / `min_lr` / `start_wd` / `end_wd` entries override
the scheduler's, as in Megatron.

Resuming (`load_state_dict`): with override_opt_param_scheduler this run's
values win; with use_checkpoint_opt_param_scheduler the checkpoint's win;
with neither, any difference is an error naming the field.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
LR_WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")


def _check_steps(name: str, value, minimum: int) -> None:
    # Real numbers are allowed: Megatron's warmup can be a fraction of the decay steps.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= minimum:
        raise ValueError(f"{name} must be a number >= {minimum}, got {value!r}")


class OptimizerParamScheduler:
    """Anneals the learning rate and weight decay of `optimizer`'s param groups.

    Same signature and semantics as megatron.core.optimizer_param_scheduler.
    `step(increment=1)` advances by `increment` steps and writes `lr` and
    `weight_decay` into every param group.
    """

    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float,
                 wd_incr_steps: int = 0, wd_incr_style: str = "constant",
                 use_checkpoint_opt_param_scheduler: Optional[bool] = True,
                 override_opt_param_scheduler: Optional[bool] = False,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: Optional[str] = None):
        if lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {LR_DECAY_STYLES}, got {lr_decay_style!r}")
        if not 0.0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")
        if init_lr > max_lr:
            raise ValueError(f"init_lr ({init_lr}) must not exceed max_lr ({max_lr})")
        _check_steps("lr_decay_steps", lr_decay_steps, 1)
        _check_steps("lr_warmup_steps", lr_warmup_steps, 0)
        if lr_warmup_steps >= lr_decay_steps:
            raise ValueError(f"lr_warmup_steps ({lr_warmup_steps}) must be smaller than lr_decay_steps "
                             f"({lr_decay_steps})")
        if lr_decay_style == "WSD":
            if wsd_decay_steps is None:
                raise ValueError("lr_decay_style='WSD' needs wsd_decay_steps (the annealing steps at the end)")
            _check_steps("wsd_decay_steps", wsd_decay_steps, 0)
            if lr_wsd_decay_style not in LR_WSD_DECAY_STYLES:
                raise ValueError(f"lr_decay_style='WSD' needs lr_wsd_decay_style in {LR_WSD_DECAY_STYLES}, "
                                 f"got {lr_wsd_decay_style!r}")
        if not 0.0 <= start_wd <= end_wd:
            raise ValueError(f"need 0 <= start_wd <= end_wd, got start_wd={start_wd}, end_wd={end_wd}")
        if wd_incr_style not in WD_INCR_STYLES:
            raise ValueError(f"wd_incr_style must be one of {WD_INCR_STYLES}, got {wd_incr_style!r}")
        if wd_incr_style == "constant" and start_wd != end_wd:
            raise ValueError(f"wd_incr_style='constant' needs start_wd == end_wd, got {start_wd} and {end_wd}: "
                             "use 'linear' or 'cosine' to change the weight decay")
        # linear/cosine divide by wd_incr_steps at step 0.
        _check_steps("wd_incr_steps", wd_incr_steps, 0 if wd_incr_style == "constant" else 1)
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ValueError("override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are both set: "
                             "pick one (override: this run's values win; use_checkpoint: the checkpoint's win)")
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    def get_wd(self, param_group: Optional[dict] = None) -> float:
        """The weight decay at the current step, before the group's wd_mult."""
        group = param_group or {}
        start_wd = group.get("start_wd", self.start_wd)
        end_wd = group.get("end_wd", self.end_wd)
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return start_wd + coeff * (end_wd - start_wd)

    def get_lr(self, param_group: Optional[dict] = None) -> float:
        """The learning rate at the current step for `param_group`."""
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            return max(min_lr, max_lr * warmup ** 0.5 / max(self.num_steps, 1) ** 0.5)
        ratio = float(self.num_steps - self.lr_warmup_steps) / float(self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: hold max_lr, then anneal over the last wsd_decay_steps
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= anneal_start:
                coeff = 1.0
            else:
                wsd_ratio = float(self.num_steps - anneal_start) / float(self.wsd_decay_steps)
                coeff = {"linear": lambda r: 1.0 - r,
                         "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0,
                         "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style](wsd_ratio)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int = 1) -> None:
        """Advance `increment` steps; set every group's lr and weight decay."""
        self.num_steps += increment
        for group in self.optimizer.param_groups:
            lr = self.get_lr(group)
            if isinstance(group.get("lr"), torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
            group["weight_decay"] = self.get_wd(group) * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.lr_warmup_steps, "num_steps": self.num_steps,
                "lr_decay_style": self.lr_decay_style, "lr_decay_steps": self.lr_decay_steps,
                "min_lr": self.min_lr, "start_wd": self.start_wd, "end_wd": self.end_wd,
                "wd_incr_style": self.wd_incr_style, "wd_incr_steps": self.wd_incr_steps}

    def _check_and_set(self, cls_value, sd_value, name: str):
        if self.override_opt_param_scheduler:
            if cls_value != sd_value:
                logger.info("overriding checkpointed %s %r with this run's %r", name, sd_value, cls_value)
            return cls_value
        if not self.use_checkpoint_opt_param_scheduler and cls_value != sd_value:
            raise ValueError(
                f"OptimizerParamScheduler: this run's {name} is {cls_value!r} but the checkpoint's is "
                f"{sd_value!r}: set override_opt_param_scheduler (--override-opt-param-scheduler) to use "
                f"this run's values, or use_checkpoint_opt_param_scheduler "
                f"(--use-checkpoint-opt-param-scheduler) to use the checkpoint's")
        return sd_value

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the step count and, per the override / use-checkpoint
        settings, the schedule. Accepts Megatron's older key names."""
        def pick(*keys):
            for key in keys:
                if key in state_dict:
                    return state_dict[key]
            raise KeyError(f"scheduler state dict has none of {keys}; keys: {sorted(state_dict)}")

        max_lr = self._check_and_set(self.max_lr, pick("start_lr", "max_lr"), "max_lr (learning rate)")
        min_lr = self._check_and_set(self.min_lr, state_dict["min_lr"], "min_lr (minimum learning rate)")
        warmup = self._check_and_set(self.lr_warmup_steps, pick("warmup_iter", "warmup_steps", "lr_warmup_steps"),
                                     "lr_warmup_steps (warmup iterations)")
        decay = self._check_and_set(self.lr_decay_steps, pick("end_iter", "decay_steps", "lr_decay_steps"),
                                    "lr_decay_steps (total number of iterations)")
        style = self._check_and_set(self.lr_decay_style, pick("decay_style", "lr_decay_style"),
                                    "lr_decay_style (learning rate decay style)")
        wd = None
        if "start_wd" in state_dict:  # checkpoints from before weight-decay scheduling lack these
            wd = (self._check_and_set(self.start_wd, state_dict["start_wd"], "start_wd (start weight decay)"),
                  self._check_and_set(self.end_wd, state_dict["end_wd"], "end_wd (end weight decay)"),
                  self._check_and_set(self.wd_incr_steps, state_dict["wd_incr_steps"],
                                      "wd_incr_steps (total number of weight decay iterations)"),
                  self._check_and_set(self.wd_incr_style, state_dict["wd_incr_style"],
                                      "wd_incr_style (weight decay incr style)"))
        # All checks pass before anything changes, so a mismatch leaves this scheduler as it was.
        self.max_lr, self.min_lr, self.lr_warmup_steps, self.lr_decay_steps, self.lr_decay_style = (
            float(max_lr), min_lr, warmup, decay, style)
        if wd is not None:
            self.start_wd, self.end_wd, self.wd_incr_steps, self.wd_incr_style = wd
        # A load replaces the step count (Megatron adds it to a fresh
        # scheduler's 0), and the schedule it restores is applied at once.
        self.num_steps = 0
        self.step(pick("num_iters", "num_steps"))
