"""Loss scalers against Megatron-Core's rules."""

import random

import pytest
import torch

from megatron_fsdp.optimizer import ConstantGradScaler, DynamicGradScaler


class MegatronRules:
    """Megatron-Core 0.19's DynamicGradScaler.update, restated in plain floats."""

    def __init__(self, scale, min_scale, growth, backoff, window, hysteresis):
        self.scale, self.min_scale, self.growth, self.backoff = scale, min_scale, growth, backoff
        self.window, self.hysteresis = window, hysteresis
        self.clean, self.left = 0, hysteresis

    def update(self, found_inf):
        if found_inf:
            self.clean, self.left = 0, self.left - 1
            if self.left <= 0:
                self.scale = max(self.scale * self.backoff, self.min_scale)
        else:
            self.clean += 1
            if self.clean == self.window:
                self.clean, self.left, self.scale = 0, self.hysteresis, self.scale * self.growth


def _dynamic(**kw):
    args = dict(initial_scale=2.0 ** 16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                hysteresis=2, device="cpu")
    args.update(kw)
    return DynamicGradScaler(**args)


def test_growth_after_window_clean_steps():
    s = _dynamic()
    for _ in range(2):
        s.update(False)
    assert s.scale.item() == 2.0 ** 16
    s.update(False)
    assert s.scale.item() == 2.0 ** 17 and s.scale.dtype == torch.float32 and s.scale.shape == (1,)
    assert s.inv_scale.item() == 2.0 ** -17


def test_backoff_after_hysteresis_overflows_and_each_one_after():
    s = _dynamic()
    s.update(True)
    assert s.scale.item() == 2.0 ** 16, "the first overflow only uses up hysteresis"
    s.update(True)
    assert s.scale.item() == 2.0 ** 15
    s.update(True)
    assert s.scale.item() == 2.0 ** 14, "without a full clean window, every later overflow halves again"
    s.update(False)
    s.update(True)
    assert s.scale.item() == 2.0 ** 13, "a clean step between does not restore hysteresis"
    for _ in range(3):
        s.update(False)
    assert s.scale.item() == 2.0 ** 14
    s.update(True)
    assert s.scale.item() == 2.0 ** 14, "a growth restores the hysteresis"


def test_min_scale_is_a_floor():
    s = _dynamic(initial_scale=4.0, min_scale=2.0, hysteresis=1)
    for _ in range(5):
        s.update(True)
    assert s.scale.item() == 2.0


def test_random_sequence_matches_megatron_rules():
    rng = random.Random(0)
    s = _dynamic(initial_scale=2.0 ** 20, min_scale=4.0, growth_interval=4, hysteresis=3)
    ref = MegatronRules(2.0 ** 20, 4.0, 2.0, 0.5, 4, 3)
    for step in range(400):
        flag = rng.random() < 0.35
        s.update(flag)
        ref.update(flag)
        assert s.scale.item() == ref.scale, step
        assert s.state_dict()["growth_tracker"] == ref.clean and s.state_dict()["hysteresis_tracker"] == ref.left


def test_state_round_trip():
    s = _dynamic()
    s.update(True)
    s.update(True)
    s.update(False)
    state = s.state_dict()
    assert set(state) == {"scale", "growth_tracker", "hysteresis_tracker"}
    t = _dynamic(initial_scale=8.0)
    t.load_state_dict(state)
    assert (t.scale.item(), t._growth_tracker, t._hysteresis_tracker) == (2.0 ** 15, 1, 0)
    t.scale.mul_(3)  # loading must copy the tensor, not share it
    assert s.scale.item() == 2.0 ** 15
    t.load_state_dict(state)
    for flag in (False, False, True):
        s.update(flag)
        t.update(flag)
    assert t.scale.item() == s.scale.item() == 2.0 ** 16
    with pytest.raises(ValueError, match=r"lacks \['growth_tracker', 'hysteresis_tracker'\]"):
        t.load_state_dict({"scale": torch.ones(1)})


def test_constant_scaler_never_moves():
    s = ConstantGradScaler(1024.0, device="cpu")
    for flag in (True, True, False, True):
        s.update(flag)
    assert s.scale.item() == 1024.0 and s.state_dict() == {}


@pytest.mark.parametrize("kw,match", [
    (dict(initial_scale=0.0), "initial_scale must be a positive number, got 0.0"),
    (dict(min_scale=2.0 ** 17), r"min_scale \(131072.0\) must not exceed initial_scale"),
    (dict(growth_factor=1.0), "growth_factor must be > 1, got 1.0"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\), got 1.0"),
    (dict(growth_interval=0), "growth_interval must be a positive integer, got 0"),
    (dict(hysteresis=1.5), "hysteresis must be a positive integer, got 1.5"),
])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        _dynamic(**kw)
