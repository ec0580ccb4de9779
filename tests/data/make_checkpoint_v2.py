"""Writes tests/data/checkpoint_v2/: a checkpoint of format version 2 (DCP for
the model and optimizer, common.pt, rng/rank_00000.pt) and expected.pt, what a
load must restore. It was run once, at commit f551250 (the last version that
wrote this format), so that tests/test_checkpoint_formats.py proves that later
versions still load it; rerunning it with a later version writes that
version's format instead.

    python tests/data/make_checkpoint_v2.py
"""

import os
import random
import shutil
import sys
import warnings

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_fsdp.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron_fsdp.training.checkpointing import save_checkpoint  # noqa: E402


def build(seed: int):
    """The fixture's model (fp16, fp32 main params, a dynamic loss scaler) and scheduler."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(torch.float16)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, fp16=True, params_dtype=torch.float16,
                                                       initial_loss_scale=2.0 ** 10, hysteresis=1), model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                        use_checkpoint_opt_param_scheduler=False)
    return model, optimizer, scheduler


def main() -> None:
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    out = os.path.join(HERE, "checkpoint_v2")
    shutil.rmtree(out, ignore_errors=True)
    model, optimizer, scheduler = build(0)
    for overflow in (False, True, False):
        loss = model(torch.ones(2, 4, dtype=torch.float16)).float().square().sum()
        optimizer.scale_loss(loss).backward()
        if overflow:
            model[0].weight.grad[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    random.seed(7)
    torch.manual_seed(7)
    save_checkpoint(3, model, optimizer, scheduler, out, extra_state={"consumed_train_samples": 24})
    inner = optimizer.optimizer
    expected = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "main_params": {n: t.clone() for n, t in optimizer.main_params_state_dict(model).items()},
        "exp_avg": [inner.state[p]["exp_avg"].clone() for g in inner.param_groups for p in g["params"]],
        "grad_scaler": {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in optimizer.grad_scaler.state_dict().items()},
        "scheduler_num_steps": scheduler.num_steps,
        "lr": optimizer.param_groups[0]["lr"],
        "next_torch_rand": torch.rand(3),  # the RNG as saved, drawn after the save
        "next_python_random": random.random(),
    }
    torch.save(expected, os.path.join(out, "expected.pt"))
    print("wrote", out, sorted(os.listdir(os.path.join(out, "iter_0000003"))))


if __name__ == "__main__":
    main()
