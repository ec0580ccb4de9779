"""OptimizerParamScheduler: Megatron-Core's learning-rate schedule.

Linear warmup from init_lr to max_lr over lr_warmup_steps, then decay to
min_lr over the remaining lr_decay_steps: constant, linear or cosine. Weight
decay stays constant (start_wd == end_wd); other increment styles raise.
"""

from __future__ import annotations

import math

_DECAY_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str, start_wd: float, end_wd: float,
                 wd_incr_steps: int = 0, wd_incr_style: str = "constant",
                 use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False):
        if lr_decay_style not in _DECAY_STYLES:
            raise ValueError(f"lr_decay_style must be one of {_DECAY_STYLES}, got {lr_decay_style!r}")
        if not 0 <= min_lr <= max_lr:
            raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")
        if lr_decay_steps <= 0 or lr_warmup_steps < 0:
            raise ValueError(f"need lr_decay_steps > 0 and lr_warmup_steps >= 0, got {lr_decay_steps} "
                             f"and {lr_warmup_steps}")
        if lr_decay_style != "constant" and lr_warmup_steps >= lr_decay_steps:
            raise ValueError(f"lr_warmup_steps ({lr_warmup_steps}) must be smaller than lr_decay_steps "
                             f"({lr_decay_steps})")
        if not use_checkpoint_opt_param_scheduler or override_opt_param_scheduler:
            raise NotImplementedError(
                "use_checkpoint_opt_param_scheduler=False / override_opt_param_scheduler=True are not "
                "supported: the checkpointed schedule is always used and must match this run's")
        if start_wd != end_wd or wd_incr_style != "constant":
            raise NotImplementedError("weight-decay increments are not supported: use start_wd == end_wd")
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = init_lr, max_lr, min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wd = start_wd
        self.num_steps = 0
        self.step(0)

    def get_lr(self) -> float:
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.lr_decay_steps:
            return self.min_lr
        ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> None:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.lr_warmup_steps,
                "lr_decay_steps": self.lr_decay_steps, "lr_decay_style": self.lr_decay_style,
                "num_steps": self.num_steps, "init_lr": self.init_lr}

    def load_state_dict(self, state: dict) -> None:
        for key in ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "init_lr"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"checkpointed scheduler {key}={state[key]!r} differs from this run's {getattr(self, key)!r}"
                )
        self.num_steps = 0
        self.step(state["num_steps"])
