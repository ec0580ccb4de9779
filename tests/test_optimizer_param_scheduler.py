"""OptimizerParamScheduler against schedules computed the way Megatron-Core computes them."""

import math

import pytest
import torch
from torch import nn

from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.optimizer_param_scheduler import OptimizerParamScheduler


def megatron_lr(step, init_lr, max_lr, min_lr, warmup, decay, style, wsd_steps=None, wsd_style=None):
    """Megatron-Core 0.19's OptimizerParamScheduler.get_lr, restated."""
    if warmup > 0 and step <= warmup:
        return init_lr + (max_lr - init_lr) * step / warmup
    if style == "constant":
        return max_lr
    if step > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
    ratio = (step - warmup) / (decay - warmup)
    if style == "linear":
        coeff = 1 - ratio
    elif style == "cosine":
        coeff = (math.cos(math.pi * ratio) + 1) / 2
    else:
        start = decay - wsd_steps
        r = (step - start) / wsd_steps if step > start else None
        coeff = 1.0 if r is None else {"linear": 1 - r, "cosine": (math.cos(math.pi * r) + 1) / 2,
                                       "exponential": 2 * 0.5 ** r - 1, "minus_sqrt": 1 - math.sqrt(r)}[wsd_style]
    return min_lr + coeff * (max_lr - min_lr)


def megatron_wd(step, start_wd, end_wd, incr_steps, style):
    """Megatron-Core 0.19's OptimizerParamScheduler.get_wd, restated."""
    if step > incr_steps or style == "constant":
        return end_wd
    ratio = step / incr_steps
    coeff = ratio if style == "linear" else (math.cos(math.pi * (1 - ratio)) + 1) / 2
    return start_wd + coeff * (end_wd - start_wd)


def _sgd():
    return torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)


LR = dict(init_lr=0.01, max_lr=1.0, min_lr=0.1, lr_warmup_steps=4, lr_decay_steps=20)


@pytest.mark.parametrize("style,wsd", [("constant", None), ("linear", None), ("cosine", None),
                                       ("inverse-square-root", None), ("WSD", "linear"), ("WSD", "cosine"),
                                       ("WSD", "exponential"), ("WSD", "minus_sqrt")])
def test_every_megatron_lr_decay_style(style, wsd):
    opt = _sgd()
    extra = dict(wsd_decay_steps=6, lr_wsd_decay_style=wsd) if style == "WSD" else {}
    sched = OptimizerParamScheduler(opt, **LR, lr_decay_style=style, start_wd=0.0, end_wd=0.0, **extra)
    for step in range(25):
        want = megatron_lr(step, 0.01, 1.0, 0.1, 4, 20, style, 6, wsd)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), (style, wsd, step)
        sched.step()
    if style == "inverse-square-root":  # a value by hand: 1.0 * sqrt(4) / sqrt(16)
        sched.num_steps = 0
        sched.step(16)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.5)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increments_reach_decayed_groups_only(style):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.0), model)
    decay, no_decay = opt.param_groups
    assert (decay["wd_mult"], no_decay["wd_mult"]) == (1.0, 0.0)
    sched = OptimizerParamScheduler(opt, 0.0, 1e-3, 0.0, 1, 10, "cosine", start_wd=0.01, end_wd=0.1,
                                    wd_incr_steps=8, wd_incr_style=style)
    seen = []
    for step in range(12):
        want = megatron_wd(step, 0.01, 0.1, 8, style)
        assert decay["weight_decay"] == pytest.approx(want, rel=1e-12) and sched.get_wd() == pytest.approx(want)
        assert no_decay["weight_decay"] == 0.0
        seen.append(decay["weight_decay"])
        sched.step()
    assert seen[0] == pytest.approx(0.01) and seen[4] == pytest.approx(0.055) and seen[11] == 0.1

    # A checkpoint written before groups had wd_mult must not make norms decay.
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["wd_mult"]
    opt.load_state_dict(saved)
    sched.step()
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_group_overrides_and_tensor_lr():
    opt = torch.optim.SGD([{"params": [nn.Parameter(torch.zeros(1))], "max_lr": 2.0, "min_lr": 0.5,
                            "lr": torch.tensor(0.0)},
                           {"params": [nn.Parameter(torch.zeros(1))], "start_wd": 0.2, "end_wd": 0.4, "wd_mult": 0.5}],
                          lr=0.0)
    sched = OptimizerParamScheduler(opt, 0.0, 1.0, 0.1, 2, 10, "linear", 0.0, 0.2, 10, "linear")
    sched.step(6)
    assert opt.param_groups[0]["lr"].item() == pytest.approx(megatron_lr(6, 0.0, 2.0, 0.5, 2, 10, "linear"))
    assert opt.param_groups[1]["lr"] == pytest.approx(megatron_lr(6, 0.0, 1.0, 0.1, 2, 10, "linear"))
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(megatron_wd(6, 0.0, 0.2, 10, "linear"))
    assert opt.param_groups[1]["weight_decay"] == pytest.approx(0.5 * megatron_wd(6, 0.2, 0.4, 10, "linear"))


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr_decay_style="step"), r"lr_decay_style must be one of .*'WSD'.*got 'step'"),
    (dict(lr_decay_style="WSD"), "needs wsd_decay_steps"),
    (dict(lr_decay_style="WSD", wsd_decay_steps=3, lr_wsd_decay_style="step"), "lr_wsd_decay_style in"),
    (dict(lr_warmup_steps=20), r"lr_warmup_steps \(20\) must be smaller than lr_decay_steps \(20\)"),
    (dict(lr_decay_style="constant", lr_warmup_steps=20), "must be smaller than lr_decay_steps"),
    (dict(init_lr=2.0), r"init_lr \(2.0\) must not exceed max_lr"),
    (dict(min_lr=2.0), "need 0 <= min_lr <= max_lr"),
    (dict(end_wd=0.1), r"wd_incr_style='constant' needs start_wd == end_wd, got 0.0 and 0.1"),
    (dict(end_wd=0.1, wd_incr_style="linear"), r"wd_incr_steps must be a number >= 1, got 0"),
    (dict(end_wd=0.1, wd_incr_steps=5, wd_incr_style="exp"), "wd_incr_style must be one of"),
    (dict(start_wd=0.2, end_wd=0.1, wd_incr_steps=5, wd_incr_style="linear"), "need 0 <= start_wd <= end_wd"),
    (dict(override_opt_param_scheduler=True), "both set"),
    (dict(lr_warmup_steps=None), "lr_warmup_steps must be a number >= 0, got None"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=2, lr_decay_steps=20, lr_decay_style="linear",
                start_wd=0.0, end_wd=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        OptimizerParamScheduler(_sgd(), **args)


def _sched(opt, decay_steps=20, max_lr=1.0, **kwargs):
    return OptimizerParamScheduler(opt, 0.0, max_lr, 0.1, 2, decay_steps, "cosine", 0.01, 0.05, decay_steps,
                                   "linear", **kwargs)


def _saved_at(step, decay_steps=20):
    sched = _sched(_sgd(), decay_steps)
    sched.step(step)
    return sched.state_dict()


def test_state_dict_keys_are_megatrons():
    assert sorted(_saved_at(3)) == sorted(["max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style",
                                           "lr_decay_steps", "min_lr", "start_wd", "end_wd", "wd_incr_style",
                                           "wd_incr_steps"])


def test_resume_with_more_decay_steps_needs_a_mode():
    saved = _saved_at(12)
    neither = _sched(_sgd(), 40, use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match=r"lr_decay_steps \(total number of iterations\) is 40 but the "
                                         r"checkpoint's is 20.*--override-opt-param-scheduler"):
        neither.load_state_dict(saved)
    assert neither.num_steps == 0 and neither.lr_decay_steps == 40, "a failed load must change nothing"

    same = _sched(opt := _sgd(), 20, use_checkpoint_opt_param_scheduler=False)
    same.load_state_dict(saved)
    assert same.num_steps == 12 and opt.param_groups[0]["lr"] == pytest.approx(
        megatron_lr(12, 0.0, 1.0, 0.1, 2, 20, "cosine"))

    # override: this run's schedule (decay over 40 steps) continues from step 12
    override = _sched(opt := _sgd(), 40, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
    override.load_state_dict(saved)
    assert (override.num_steps, override.lr_decay_steps, override.wd_incr_steps) == (12, 40, 40)
    assert opt.param_groups[0]["lr"] == pytest.approx(megatron_lr(12, 0.0, 1.0, 0.1, 2, 40, "cosine"))
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(megatron_wd(12, 0.01, 0.05, 40, "linear"))

    # use_checkpoint: the checkpoint's schedule wins over this run's
    use_ckpt = _sched(opt := _sgd(), 40, max_lr=3.0, use_checkpoint_opt_param_scheduler=True)
    use_ckpt.load_state_dict(saved)
    assert (use_ckpt.lr_decay_steps, use_ckpt.max_lr, use_ckpt.wd_incr_steps) == (20, 1.0, 20)
    assert opt.param_groups[0]["lr"] == pytest.approx(megatron_lr(12, 0.0, 1.0, 0.1, 2, 20, "cosine"))
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(megatron_wd(12, 0.01, 0.05, 20, "linear"))


def test_loads_megatron_legacy_keys_and_pre_wd_checkpoints():
    legacy = {"start_lr": 1.0, "min_lr": 0.1, "warmup_iter": 2, "end_iter": 20, "decay_style": "cosine",
              "num_iters": 7}
    sched = _sched(opt := _sgd(), 20, use_checkpoint_opt_param_scheduler=False)
    sched.load_state_dict(legacy)
    assert sched.num_steps == 7 and sched.wd_incr_steps == 20
    assert opt.param_groups[0]["lr"] == pytest.approx(megatron_lr(7, 0.0, 1.0, 0.1, 2, 20, "cosine"))
