"""get_megatron_optimizer and OptimizerParamScheduler on their own (more: test_optimizer_param_scheduler.py)."""

import math

import pytest
import torch
from torch import nn

from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.optimizer_param_scheduler import OptimizerParamScheduler


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def test_optimizer_groups_step_protocol_and_clipping():
    model = _model()
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.5, clip_grad=0.01), model)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.5 and all(p.dim() == 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() == 1 for p in no_decay["params"])
    assert opt.optimizer.defaults["fused"] is True, "CPU float params should take the fused AdamW path"
    model(torch.randn(3, 4)).square().sum().backward()
    norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
    before = [p.detach().clone() for p in model.parameters()]
    ok, grad_norm, zeros = opt.step()
    assert ok and zeros is None and math.isclose(grad_norm, norm, rel_tol=1e-6)
    clipped = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
    assert math.isclose(clipped, 0.01, rel_tol=1e-3), "gradients must be clipped to clip_grad"
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_post_step_hooks_the_model_carries_run_after_every_step_taken_or_skipped():
    from megatron_fsdp.utils import register_post_step_hook

    model = _model()
    ran = []
    register_post_step_hook(model[0], "first", lambda: ran.append("first"))
    register_post_step_hook(model[2], "last", lambda: ran.append("stale"))
    register_post_step_hook(model[2], "last", lambda: ran.append("last"))  # the same name replaces it
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.1, fp16=True, initial_loss_scale=2.0 ** 8,
                                                 params_dtype=torch.float16), model.half())
    opt.register_step_post_hook(lambda: ran.append("extra"))
    opt.scale_loss(model(torch.randn(3, 4).half()).float().square().sum()).backward()
    assert opt.step()[0] and ran == ["first", "last", "extra"]
    opt.zero_grad()
    opt.scale_loss(model(torch.randn(3, 4).half()).float().square().sum()).backward()
    for p in model.parameters():
        p.grad.fill_(float("inf"))  # an overflow: the step is skipped, the hooks still run
    ran.clear()
    assert opt.step() == (False, None, None) and ran == ["first", "last", "extra"]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(lr=None), ValueError, "lr must be a positive number"),
    (dict(lr=1.0, optimizer="lamb"), ValueError, "got 'lamb'"),
    (dict(lr=1.0, clip_grad=-1.0), ValueError, "clip_grad must be >= 0"),
    (dict(lr=1.0, params_dtype=torch.int8), ValueError, "params_dtype must be one of"),
    (dict(lr=1.0, params_dtype=torch.float16), ValueError, "params_dtype=torch.float16 needs fp16=True"),
    (dict(lr=1.0, fp16=True, bf16=True), ValueError, "fp16 and bf16 cannot both be True"),
    (dict(lr=1.0, loss_scale=128.0), ValueError, "loss_scale=128.0 needs fp16=True or bf16=True"),
    (dict(lr=1.0, fp16=True, loss_scale=0), ValueError, "loss_scale must be a positive number"),
    (dict(lr=1.0, fp16=True, min_loss_scale=2.0 ** 40), ValueError, r"min_scale \(1099511627776.0\) must not exceed"),
    (dict(lr=1.0, fp16=True, hysteresis=0), ValueError, "hysteresis must be a positive integer, got 0"),
    (dict(lr=1.0, fp16=True, loss_scale_window=0.5), ValueError, "growth_interval must be a positive integer"),
])
def test_optimizer_config_rejects(kwargs, error, match):
    with pytest.raises(error, match=match):
        OptimizerConfig(**kwargs)


def _bf16_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(torch.bfloat16)


BF16 = dict(lr=1e-4, weight_decay=0.1, clip_grad=0.5, bf16=True, params_dtype=torch.bfloat16)


def test_bf16_params_are_stepped_through_fp32_main_params():
    model = _bf16_model()
    initial = {n: p.detach().float() for n, p in model.named_parameters()}
    opt = get_megatron_optimizer(OptimizerConfig(**BF16), model)
    mains = opt.main_params_state_dict(model)
    assert mains.keys() == initial.keys() and all(m.dtype == torch.float32 for m in mains.values())
    stepped = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in stepped), "the torch optimizer must step the fp32 copies"

    # Reference: AdamW on fp32 copies, fed the bf16 gradients, clipped alike.
    ref = {n: p.clone().requires_grad_(True) for n, p in initial.items()}
    ref_opt = torch.optim.AdamW([{"params": [ref["0.weight"], ref["2.weight"]], "weight_decay": 0.1},
                                 {"params": [ref[n] for n in ("0.bias", "1.weight", "1.bias", "2.bias")],
                                  "weight_decay": 0.0}], lr=1e-4)
    x = torch.randn(16, 4).bfloat16()
    for _ in range(3):
        model(x).float().square().mean().backward()
        for n, p in model.named_parameters():
            ref[n].grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(ref.values(), 0.5)
        opt.step()
        ref_opt.step()
        assert all(p.grad is None for p in model.parameters()), "bf16 gradients move into the fp32 ones"
        opt.zero_grad()
        ref_opt.zero_grad()
    for n, p in model.named_parameters():
        # Steps of 1e-4 are below bf16's resolution: only the fp32 copy keeps them.
        torch.testing.assert_close(mains[n], ref[n].detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), mains[n].to(torch.bfloat16)), f"{n}: model must hold its rounded main param"
    assert any(not torch.equal(mains[n], initial[n]) for n in mains)

    other = get_megatron_optimizer(OptimizerConfig(**BF16), _bf16_model(seed=1))
    other.load_state_dict(opt.state_dict())
    for mine, theirs in zip(opt.state_dict()["fp32_from_fp16_params"], other.state_dict()["fp32_from_fp16_params"]):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))

    with pytest.raises(ValueError, match=r"parameter 0.weight is torch.bfloat16, but OptimizerConfig.params_dtype="
                                         r"torch.float32"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-4, bf16=True), _bf16_model())


def test_scheduler_warmup_then_cosine_and_state_round_trip():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=2,
                                    lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(12):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[:3] == [0.0, 0.5, 1.0]
    assert math.isclose(lrs[6], 0.1 + 0.9 * 0.5 * (math.cos(math.pi * 4 / 8) + 1))
    assert lrs[10] == pytest.approx(0.1) and lrs[12] == 0.1
    other = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=2,
                                    lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0)
    other.load_state_dict(sched.state_dict())
    assert other.num_steps == 12 and opt.param_groups[0]["lr"] == 0.1
    mismatched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=2.0, min_lr=0.1, lr_warmup_steps=2,
                                         lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                         use_checkpoint_opt_param_scheduler=False)
    with pytest.raises(ValueError, match=r"max_lr \(learning rate\) is 2.0 but the checkpoint's is 1.0"):
        mismatched.load_state_dict(sched.state_dict())
    with pytest.raises(ValueError, match="lr_decay_style must be one of"):
        OptimizerParamScheduler(opt, 0.0, 1.0, 0.0, 0, 10, "step", 0.0, 0.0)
