"""fp16 checkpoints: the loss scaler's state survives a save and load, and
moves across precision changes on resume as Megatron's does."""

import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from helpers import make_config, setup_parallel
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.dist_checkpointing import entries, torch_dcp
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import DynamicGradScaler, OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training import checkpointing
from megatron_fsdp.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint

SEQ, MICRO, VOCAB = 16, 2, 64
SAVE_AT, LAST = 5, 8
# Steps 2 and 3 use up the hysteresis and back the scale off; step 6, after
# the resume, backs off again only with the restored hysteresis tracker.
OVERFLOW_AT = (2, 3, 6)
FP16 = dict(lr=1e-2, adam_eps=1e-5, fp16=True, initial_loss_scale=2.0 ** 12, hysteresis=2, loss_scale_window=4)
INITIAL_STATE = {"scale": 2.0 ** 12, "growth_tracker": 0, "hysteresis_tracker": 2}
SAVED_STATE = {"scale": 2.0 ** 11, "growth_tracker": 2, "hysteresis_tracker": 0}


def _plain(scaler) -> dict:
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in scaler.state_dict().items()}


def _build_fsdp(seed):
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(1234 + seed)
    cfg = make_config(fp16=True)
    model = GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    model = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(**FP16), model)
    assert isinstance(optimizer.grad_scaler, DynamicGradScaler) and _plain(optimizer.grad_scaler) == INITIAL_STATE
    return model, optimizer


def _train(model, optimizer, first, last):
    """(loss, update_successful, scaler state) of each step."""
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    trace = []
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (dp * MICRO, SEQ + 1), generator=g)[rank * MICRO:(rank + 1) * MICRO]
        loss = model(ids[:, :-1], None, None, labels=ids[:, 1:]).float().mean()
        optimizer.scale_loss(loss).backward()
        model.finish_grad_sync()
        if step in OVERFLOW_AT and dist.get_rank() == dist.get_world_size() - 1:
            for p in model.parameters():
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if local.numel():
                    local.view(-1)[0] = float("inf")
                    break
        ok, _, _ = optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
        trace.append((reported.item() / dp, ok, _plain(optimizer.grad_scaler)))
    return trace


def _case_fp16_resume(ckpt):
    setup_parallel(1)
    model, optimizer = _build_fsdp(seed=0)
    before = _train(model, optimizer, 1, SAVE_AT)
    saved = _plain(optimizer.grad_scaler)
    save_checkpoint(SAVE_AT, model, optimizer, None, ckpt)
    uninterrupted = _train(model, optimizer, SAVE_AT + 1, LAST)

    model, optimizer = _build_fsdp(seed=1)
    loaded = load_checkpoint(model, optimizer, None, ckpt)
    assert loaded["rng_restored"]
    restored = _plain(optimizer.grad_scaler)
    assert optimizer.grad_scaler.scale.device == optimizer.grad_scaler.device
    resumed = _train(model, optimizer, SAVE_AT + 1, LAST)
    return before, saved, restored, uninterrupted, resumed


def test_fp16_fsdp_resume_restores_the_loss_scaler(pools, tmp_path):
    results = pools(2).run(_case_fp16_resume, str(tmp_path))
    for rank, (before, saved, restored, uninterrupted, resumed) in enumerate(results):
        assert [ok for _, ok, _ in before] == [step not in OVERFLOW_AT for step in range(1, SAVE_AT + 1)]
        assert saved == SAVED_STATE, f"rank {rank}: the scaler state to save must differ from a fresh one"
        assert restored == saved, f"rank {rank}: loaded scaler state {restored} != saved {saved}"
        assert resumed == uninterrupted, f"rank {rank}: resumed {resumed} != uninterrupted {uninterrupted}"
    # The restored hysteresis tracker is spent: step 6's overflow backs the scale off at once.
    assert results[0][3][0][1:] == (False, {"scale": 2.0 ** 10, "growth_tracker": 0, "hysteresis_tracker": -1})
    assert len({repr(r) for r in results}) == 1, "every rank must hold the same scaler and losses"


# ------------------------------------------------------- one process: precision changes on resume

single_process = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tiny(precision, seed=0, **overrides):
    torch.manual_seed(seed)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).to(dtype)
    config = OptimizerConfig(**dict(dict(lr=1e-3, fp16=precision == "fp16", bf16=precision == "bf16",
                                         params_dtype=dtype, initial_loss_scale=2.0 ** 10, hysteresis=1),
                                    **overrides))
    return model, get_megatron_optimizer(config, model)


def _step(model, optimizer, overflow=False):
    loss = model(torch.ones(2, 4, dtype=next(model.parameters()).dtype)).float().square().sum()
    optimizer.scale_loss(loss).backward()
    if overflow:
        model[0].weight.grad[0, 0] = float("inf")
    optimizer.step()
    optimizer.zero_grad()


def _saved_fp16(ckpt):
    model, optimizer = _tiny("fp16")
    _step(model, optimizer)
    _step(model, optimizer, overflow=True)
    _step(model, optimizer)
    assert _plain(optimizer.grad_scaler) == {"scale": 2.0 ** 9, "growth_tracker": 1, "hysteresis_tracker": 0}
    save_checkpoint(3, model, optimizer, None, ckpt)
    return model, optimizer


@single_process
def test_fp16_round_trip_in_one_process(tmp_path):
    ckpt = str(tmp_path)
    model, optimizer = _saved_fp16(ckpt)
    restored, restored_optimizer = _tiny("fp16", seed=1)
    load_checkpoint(restored, restored_optimizer, None, ckpt, load_rng=False)
    assert _plain(restored_optimizer.grad_scaler) == _plain(optimizer.grad_scaler)
    for (name, p), q in zip(model.named_parameters(), restored.parameters()):
        assert torch.equal(p, q), name

    # --no-load-optim leaves the scaler, like the rest of the optimizer, as built.
    fresh, fresh_optimizer = _tiny("fp16", seed=1)
    load_checkpoint(fresh, fresh_optimizer, None, ckpt, load_optim=False, load_rng=False)
    assert _plain(fresh_optimizer.grad_scaler) == {"scale": 2.0 ** 10, "growth_tracker": 0, "hysteresis_tracker": 1}


@single_process
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_fp16_checkpoint_resumes_without_a_scaler(tmp_path, caplog, precision):
    ckpt = str(tmp_path)
    saved_model, saved_optimizer = _saved_fp16(ckpt)
    model, optimizer = _tiny(precision, seed=1)
    with caplog.at_level(logging.INFO, logger=checkpointing.logger.name):
        load_checkpoint(model, optimizer, None, ckpt, load_rng=False)
    assert optimizer.grad_scaler is None
    assert any(r.levelno == logging.INFO and "the optimizer has no loss scaler" in r.getMessage()
               for r in caplog.records), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    # bf16 steps the saved fp32 main params; fp32 steps the fp16 weights themselves.
    expected = (saved_optimizer.main_params_state_dict(saved_model) if precision == "bf16" else
                {n: p.detach().float() for n, p in saved_model.named_parameters()})
    got = optimizer.main_params_state_dict(model) if precision == "bf16" else dict(model.named_parameters())
    for name, value in expected.items():
        assert torch.equal(got[name].detach(), value), name


@single_process
def test_checkpoint_without_scaler_state_keeps_the_current_scale(tmp_path, caplog):
    ckpt = str(tmp_path)
    model, optimizer = _tiny("bf16")
    _step(model, optimizer)
    save_checkpoint(1, model, optimizer, None, ckpt)
    fp16_model, fp16_optimizer = _tiny("fp16", seed=1)
    with caplog.at_level(logging.INFO, logger=checkpointing.logger.name):
        load_checkpoint(fp16_model, fp16_optimizer, None, ckpt, load_rng=False)
    assert _plain(fp16_optimizer.grad_scaler) == {"scale": 2.0 ** 10, "growth_tracker": 0, "hysteresis_tracker": 1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "holds no dynamic loss-scaler state" in warnings[0], caplog.text
    assert "keeping the current loss scale 1024.0" in warnings[0]

    # A constant loss scale has no state to restore, and keeps its own scale.
    constant_model, constant_optimizer = _tiny("fp16", seed=1, loss_scale=64.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=checkpointing.logger.name):
        load_checkpoint(constant_model, constant_optimizer, None, ckpt, load_rng=False)
    assert constant_optimizer.get_loss_scale().item() == 64.0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def _grad_scaler_entry(ckpt):
    path = os.path.join(ckpt, "iter_0000003")
    return entries.unpack(torch_dcp.read_entries(path, ["grad_scaler"])["grad_scaler"], "grad_scaler")


@single_process
def test_unloadable_scaler_state_fails_before_anything_is_read(tmp_path):
    ckpt = str(tmp_path)
    saved_model, saved_optimizer = _saved_fp16(ckpt)
    scaler_entry = _grad_scaler_entry(ckpt)
    assert isinstance(scaler_entry["scale"], torch.Tensor) and scaler_entry["scale"].device.type == "cpu"
    # A scaler state without its hysteresis tracker (what another scaler class would save).
    full_state = saved_optimizer.grad_scaler.state_dict
    saved_optimizer.grad_scaler.state_dict = lambda: {k: v for k, v in full_state().items()
                                                      if k != "hysteresis_tracker"}
    save_checkpoint(3, saved_model, saved_optimizer, None, ckpt)
    assert "hysteresis_tracker" not in _grad_scaler_entry(ckpt)
    model, optimizer = _tiny("fp16", seed=1)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match="loss-scaler state does not fit the optimizer's DynamicGradScaler"):
        load_checkpoint(model, optimizer, None, ckpt, load_rng=False, verify=False)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert _plain(optimizer.grad_scaler) == {"scale": 2.0 ** 10, "growth_tracker": 0, "hysteresis_tracker": 1}
