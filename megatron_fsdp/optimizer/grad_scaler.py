"""Loss scalers for fp16 training, with Megatron-Core's rules and state.

The scale is a one-element float32 tensor (Megatron's layout). `update(found_inf)`
is called once per step with the overflow flag every rank agreed on, so
every rank's scaler stays identical.

DynamicGradScaler: an overflow resets the clean-step count and uses up one
unit of hysteresis; when none is left the scale is multiplied by
`backoff_factor` (never below `min_scale`), and every further overflow backs
off again until `growth_interval` clean steps in a row multiply the scale by
`growth_factor` and restore the hysteresis.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Union

import torch

_Device = Union[str, torch.device, None]


def _default_device(device: _Device) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


class MegatronGradScaler(ABC):
    """Base class: holds the scale. `device` defaults to the current CUDA device, else CPU."""

    def __init__(self, initial_scale: float, device: _Device = None):
        self.device = _default_device(device)
        self._scale = torch.tensor([_positive("initial_scale", initial_scale)], dtype=torch.float32,
                                   device=self.device)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        # Through float64 so 1/scale is exact for every power of two float32 holds.
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        ...

    @abstractmethod
    def state_dict(self) -> dict:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None:
        ...


class ConstantGradScaler(MegatronGradScaler):
    """A fixed scale (Megatron's --loss-scale); its state is empty, as in Megatron."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale (see the module docstring for the rules).

    Megatron's training uses growth_factor=2.0, backoff_factor=0.5,
    growth_interval=--loss-scale-window, hysteresis=--hysteresis.
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, hysteresis: int, device: _Device = None):
        initial = _positive("initial_scale", initial_scale)
        if _positive("min_scale", min_scale) > initial:
            raise ValueError(f"min_scale ({min_scale}) must not exceed initial_scale ({initial_scale})")
        if _positive("growth_factor", growth_factor) <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < _positive("backoff_factor", backoff_factor) < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or value != int(value):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        super().__init__(initial, device)
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32, device=self.device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32, device=self.device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32, device=self.device)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing:
            raise ValueError(f"DynamicGradScaler state dict lacks {sorted(missing)}; keys: {sorted(state_dict)}")
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32).reshape(1)
        self._scale = scale.to(self.device).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


def build_grad_scaler(fp16: bool, loss_scale: Optional[float], initial_loss_scale: float, min_loss_scale: float,
                      loss_scale_window: float, hysteresis: int, device: _Device = None
                      ) -> Optional[MegatronGradScaler]:
    """Megatron's choice: a constant scaler when loss_scale is given, a
    dynamic one for fp16 without it, none otherwise (bf16 / fp32)."""
    if loss_scale:
        return ConstantGradScaler(loss_scale, device)
    if fp16:
        return DynamicGradScaler(initial_scale=initial_loss_scale, min_scale=min_loss_scale, growth_factor=2.0,
                                 backoff_factor=0.5, growth_interval=loss_scale_window, hysteresis=hysteresis,
                                 device=device)
    return None
