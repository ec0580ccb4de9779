"""fp16 training with Megatron's loss scaler: with and without the FSDP wrapper."""

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from helpers import full_params, make_config, setup_parallel, tiered
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import DynamicGradScaler, OptimizerConfig, get_megatron_optimizer

SEQ, MICRO, VOCAB = 16, 2, 64


def _fp16_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).half()


FP16 = dict(lr=1e-3, clip_grad=0.5, fp16=True, params_dtype=torch.float16, initial_loss_scale=2.0 ** 10,
            hysteresis=2)


def test_fp16_params_step_through_fp32_main_params_with_unscaled_grads():
    model = _fp16_mlp()
    opt = get_megatron_optimizer(OptimizerConfig(**FP16), model)
    assert isinstance(opt.grad_scaler, DynamicGradScaler) and opt.get_loss_scale().item() == 2.0 ** 10
    mains = opt.main_params_state_dict(model)
    ref = {n: m.clone().requires_grad_(True) for n, m in mains.items()}
    ref_opt = torch.optim.AdamW([{"params": [ref["0.weight"], ref["2.weight"]], "weight_decay": 0.01},
                                 {"params": [ref[n] for n in ("0.bias", "1.weight", "1.bias", "2.bias")],
                                  "weight_decay": 0.0}], lr=1e-3)
    x = torch.randn(16, 4).half()
    for _ in range(2):
        loss = model(x).float().square().mean()
        opt.scale_loss(loss).backward()
        scaled = {n: p.grad.float() for n, p in model.named_parameters()}
        for n in ref:
            ref[n].grad = scaled[n] / 2.0 ** 10  # Megatron: unscale before clipping
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.values(), 0.5).item()
        ok, norm, _ = opt.step()
        ref_opt.step()
        assert ok and norm == pytest.approx(ref_norm, rel=1e-5), "the norm is of the unscaled gradients"
        opt.zero_grad()
        ref_opt.zero_grad()
    for n, p in model.named_parameters():
        torch.testing.assert_close(mains[n], ref[n].detach(), rtol=1e-5, atol=1e-7)
        assert torch.equal(p.detach(), mains[n].half())

    # An overflow skips the update, keeps every weight and backs the scale off after `hysteresis` of them.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mains_before = {n: m.clone() for n, m in mains.items()}
    for expected_scale in (2.0 ** 10, 2.0 ** 9):
        model(x).float().sum().backward()
        model[0].weight.grad[0, 0] = float("inf")
        assert opt.step() == (False, None, None)
        assert opt.get_loss_scale().item() == expected_scale
        opt.zero_grad()
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(mains[n], mains_before[n]) for n in mains)

    state = opt.state_dict()
    assert set(state) == {"optimizer", "grad_scaler", "fp32_from_fp16_params"}
    other = get_megatron_optimizer(OptimizerConfig(**FP16), _fp16_mlp(seed=1))
    other.load_state_dict(state)
    assert other.get_loss_scale().item() == 2.0 ** 9
    assert other.grad_scaler.state_dict()["hysteresis_tracker"] == 0


def test_constant_loss_scale_and_scale_loss():
    model = _fp16_mlp()
    opt = get_megatron_optimizer(OptimizerConfig(**dict(FP16, loss_scale=64.0)), model)
    loss = model(torch.randn(3, 4).half()).float().sum()
    assert opt.scale_loss(loss).item() == pytest.approx(64.0 * loss.item())
    model[2].bias.grad = torch.full_like(model[2].bias, float("nan"))
    assert opt.step() == (False, None, None) and opt.get_loss_scale().item() == 64.0
    assert "grad_scaler" in opt.state_dict() and opt.state_dict()["grad_scaler"] == {}
    fp32 = get_megatron_optimizer(OptimizerConfig(lr=1e-3), nn.Linear(2, 2))
    assert fp32.grad_scaler is None and fp32.get_loss_scale().item() == 1.0


def _with_config(module, **precision):
    module.config = types.SimpleNamespace(**dict(dict(fp16=False, bf16=False), **precision))
    return module


@pytest.mark.parametrize("make_model,kwargs,match", [
    (_fp16_mlp, dict(lr=1e-3, params_dtype=torch.float16),
     "params_dtype=torch.float16 needs fp16=True"),
    (_fp16_mlp, dict(lr=1e-3), r"parameter 0.weight is torch.float16 but OptimizerConfig.fp16=False: "
                               r"fp16 training needs a loss scaler"),
    (lambda: _with_config(nn.Linear(2, 2), fp16=True), dict(lr=1e-3),
     r"model chunk 0 \(Linear\) has config.fp16=True but OptimizerConfig.fp16=False"),
    (lambda: _with_config(nn.Linear(2, 2), fp16=True), dict(lr=1e-3, bf16=True), "has config.fp16=True"),
    (lambda: _with_config(nn.Linear(2, 2), bf16=True), dict(lr=1e-3, fp16=True),
     r"OptimizerConfig.fp16=True but model chunk 0 \(Linear\) has config.fp16=False \(bf16=True\)"),
    (lambda: nn.Linear(2, 2).bfloat16(), dict(lr=1e-3, fp16=True), "is torch.bfloat16 but OptimizerConfig.fp16=True"),
])
def test_fp16_without_a_scaler_and_mismatches_are_rejected(make_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_megatron_optimizer(OptimizerConfig(**kwargs), make_model())


# ---- multi-process: the FSDP wrapper (fp32 master shards, fp16 compute) and TP-only fp16 models ----

def _gpt(cfg, fsdp, grad_reduce_in_fp32=False, seed=0):
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(1234 + seed)
    model = GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    if not fsdp:
        return model
    return TorchFullyShardedDataParallel(
        cfg, TorchFullyShardedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32), model)


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    ids = torch.randint(0, VOCAB, (dp * MICRO, SEQ + 1), generator=g)[rank * MICRO:(rank + 1) * MICRO]
    return ids[:, :-1], ids[:, 1:]


def _backward(model, optimizer, step, fsdp):
    tokens, labels = _data(step)
    loss = model(tokens, None, None, labels=labels).float().mean()
    optimizer.scale_loss(loss).backward()
    if fsdp:
        model.finish_grad_sync()
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
    return reported.item() / parallel_state.get_data_parallel_world_size()


def _case_overflow_on_one_rank_skips_everywhere(tp, fsdp, grad_reduce_in_fp32):
    setup_parallel(tp)
    cfg = make_config(sequence_parallel=tp > 1, fp16=True, params_dtype=torch.float32 if fsdp else torch.float16)
    model = _gpt(cfg, fsdp, grad_reduce_in_fp32)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, fp16=True, params_dtype=cfg.params_dtype,
                                                       initial_loss_scale=2.0 ** 12, hysteresis=1), model)
    grad_dtypes = set()
    skipped = 0
    for step in range(4):
        _backward(model, optimizer, step, fsdp)
        grad_dtypes |= {p.grad.dtype for p in model.parameters() if p.grad is not None}
        if step == 2 and dist.get_rank() == dist.get_world_size() - 1:
            for p in model.parameters():
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if local.numel():
                    local.view(-1)[0] = float("inf")
                    break
        before = full_params(model)
        ok, grad_norm, num_zeros = optimizer.step()
        skipped += not ok
        after = full_params(model)
        changed = any(not torch.equal(before[n], after[n]) for n in before)
        if step == 2:
            assert (ok, grad_norm, num_zeros) == (False, None, None), "every rank must skip the step"
            assert not changed, "a skipped step must leave every weight as it was"
            assert optimizer.get_loss_scale().item() == 2.0 ** 11
        else:
            assert ok and changed and grad_norm > 0
        optimizer.zero_grad()
    assert optimizer.get_loss_scale().item() == 2.0 ** 11 and skipped == 1
    return sorted(str(d) for d in grad_dtypes), optimizer.get_loss_scale().item()


@pytest.mark.parametrize("tp,fsdp,grad_reduce_in_fp32", tiered([(1, True, False), (2, True, True), (2, False, False)],
                                                            [(1, True, False)]))
def test_overflow_on_one_rank_skips_the_step_on_every_rank(pools, tp, fsdp, grad_reduce_in_fp32):
    results = pools(4).run(_case_overflow_on_one_rank_skips_everywhere, tp, fsdp, grad_reduce_in_fp32)
    assert len({repr(r) for r in results}) == 1, f"ranks disagree: {results}"
    assert results[0][1] == 2.0 ** 11
    # FSDP keeps fp32 master shards, so their gradients are fp32 whatever the reduce dtype.
    assert results[0][0] == (["torch.float32"] if fsdp else ["torch.float16"])


# Measured on CPU/gloo over 6 Adam steps: the fp16 run's losses within 2.5e-5
# (relative) of the fp32 run's, its gradient norms within 3.5e-4 (TP1) and
# 4.5e-3 (TP2). The tolerances leave room for other hardware; a loss scale
# left in the gradients would put the norm off by the scale (2**14).
FP16_LOSS_RTOL = 1e-3
FP16_NORM_RTOL = 2e-2


def _case_fp16_tracks_fp32(tp):
    setup_parallel(tp)
    losses, norms = {}, {}
    for precision in ("fp32", "fp16"):
        cfg = make_config(sequence_parallel=tp > 1, fp16=precision == "fp16")
        model = _gpt(cfg, fsdp=True)
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=3e-3, adam_eps=1e-5, fp16=precision == "fp16",
                                                           initial_loss_scale=2.0 ** 14), model)
        losses[precision], norms[precision] = [], []
        for step in range(6):
            # One batch over and over: the loss must fall, so tracking it means something.
            losses[precision].append(_backward(model, optimizer, 0, fsdp=True))
            ok, grad_norm, _ = optimizer.step()
            assert ok, f"{precision} step {step} skipped"
            norms[precision].append(grad_norm)
            optimizer.zero_grad()
    torch.testing.assert_close(torch.tensor(losses["fp16"]), torch.tensor(losses["fp32"]),
                               rtol=FP16_LOSS_RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(norms["fp16"]), torch.tensor(norms["fp32"]), rtol=FP16_NORM_RTOL, atol=0)
    assert losses["fp16"] != losses["fp32"], "the fp16 run must really compute in fp16"
    assert losses["fp32"][-1] < 0.98 * losses["fp32"][0]
    return losses


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.slow  # pool cases; fp16's representative: the overflow case above
def test_fp16_fsdp_loss_tracks_fp32(pools, tp):
    pools(4).run(_case_fp16_tracks_fp32, tp)
