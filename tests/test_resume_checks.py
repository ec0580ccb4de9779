"""What load_checkpoint checks before it reads a tensor (the learning-rate schedule), what
it reports about the vocabulary padding, and optimizer state across another grouping of
the parameters (2 ranks, gloo)."""

import os

import pytest
import torch

from helpers import (assert_close_dicts, full_params, full_tensor, make_config, on_rank_zero, setup_parallel,
                     spoil_tensor_data)
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_fsdp.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint

TRUE_VOCAB = 100


def _scheduler(optimizer, decay_steps: int = 48, **flags) -> OptimizerParamScheduler:
    return OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=0,
                                   lr_decay_steps=decay_steps, lr_decay_style="linear", start_wd=0.01, end_wd=0.01,
                                   use_checkpoint_opt_param_scheduler=False, **flags)


def _build(tp: int, vocab_rows: int):
    setup_parallel(tp)
    model = GPTModel(make_config(), vocab_size=vocab_rows, max_sequence_length=16)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), model)
    return model, optimizer, _scheduler(optimizer)


def _case_save(ckpt: str, tp: int, vocab_rows: int) -> None:
    model, optimizer, scheduler = _build(tp, vocab_rows)
    scheduler.step(8)
    save_checkpoint(1, model, optimizer, scheduler, ckpt, true_vocab_size=TRUE_VOCAB)


def _case_schedule_checked_before_the_shards(ckpt: str) -> None:
    # Every tensor's bytes are spoiled: a check that came after reading (or checksumming) one
    # would fail otherwise.
    def spoil():
        assert spoil_tensor_data(os.path.join(ckpt, "iter_0000001")) > 0
    on_rank_zero(spoil)
    model, optimizer, _ = _build(2, 128)
    scheduler = _scheduler(optimizer, decay_steps=64)
    with pytest.raises(CheckpointError, match=r"the learning-rate schedule differs from the checkpoint's: "
                                              r"OptimizerParamScheduler: this run's lr_decay_steps .* is 64 but the "
                                              r"checkpoint's is 48: set override_opt_param_scheduler "
                                              r"\(--override-opt-param-scheduler\)"):
        load_checkpoint(model, optimizer, scheduler, ckpt)
    assert (scheduler.num_steps, scheduler.lr_decay_steps) == (0, 64)  # untouched
    assert optimizer.param_groups[0]["lr"] == scheduler.get_lr()
    # With the override the schedule passes, and the spoiled shards are what stops the load next.
    scheduler = _scheduler(optimizer, decay_steps=64, override_opt_param_scheduler=True)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
        load_checkpoint(model, optimizer, scheduler, ckpt)


def test_a_changed_schedule_is_refused_before_any_tensor_is_read(pools, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    pools(2).run(_case_save, ckpt, 2, 128)
    pools(2).run(_case_schedule_checked_before_the_shards, ckpt)


def _case_load(ckpt: str, tp: int, vocab_rows: int):
    model, optimizer, scheduler = _build(tp, vocab_rows)
    loaded = load_checkpoint(model, optimizer, scheduler, ckpt, true_vocab_size=TRUE_VOCAB)
    assert scheduler.num_steps == 8
    return loaded["padded_vocab_size"]


def test_load_reports_a_different_vocabulary_padding(pools, tmp_path):
    """Saved with 128 vocabulary rows at TP=2: loaded into 104 rows at TP=1 it says (128, 104),
    into the same 128 rows nothing."""
    ckpt = str(tmp_path / "ckpt")
    pools(2).run(_case_save, ckpt, 2, 128)
    assert pools(2).run(_case_load, ckpt, 1, 104) == [(128, 104)] * 2
    assert pools(2).run(_case_load, ckpt, 2, 128) == [None] * 2


def _adam_states(model, optimizer) -> dict:
    inner = getattr(optimizer, "optimizer", optimizer)
    module = getattr(model, "module", model)
    return {f"{name}.{key}": full_tensor(inner.state[p][key]).clone() for name, p in module.named_parameters()
            for key in ("exp_avg", "exp_avg_sq")}


def _case_bare_checkpoint_into_the_wrapper(ckpt: str):
    # Saved by a bare TP=2 model (the replicated runs before they were wrapped): its plain
    # and DTensor parameters sit in optimizer groups of their own, the wrapper's do not.
    setup_parallel(2, num_distributed_optimizer_instances=2)  # TP=2 x DP=2, replicated as pretrain() does
    cfg = make_config(bf16=True)
    bare = GPTModel(cfg, vocab_size=128, max_sequence_length=16)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), bare)
    for p in bare.parameters():
        p.grad = torch.full_like(p, 0.5)
    optimizer.step()
    save_checkpoint(1, bare, optimizer, None, ckpt)
    expected = _adam_states(bare, optimizer)
    wrapped = TorchFullyShardedDataParallel(
        cfg, TorchFullyShardedDataParallelConfig(num_distributed_optimizer_instances=2, grad_reduce_in_fp32=True,
                                                 reshard_after_forward=False),
        GPTModel(cfg, vocab_size=128, max_sequence_length=16))
    loaded_optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), wrapped)
    assert len(loaded_optimizer.param_groups) != len(optimizer.param_groups)
    load_checkpoint(wrapped, loaded_optimizer, None, ckpt)
    assert_close_dicts(full_params(wrapped.module), full_params(bare), "weights", rtol=0, atol=0)
    assert_close_dicts(_adam_states(wrapped, loaded_optimizer), expected, "Adam moments", rtol=0, atol=0)
    # The groups and their settings are the loading run's own, and it steps.
    fresh = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), wrapped).param_groups
    assert [{k: v for k, v in g.items() if k != "params"} for g in loaded_optimizer.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in fresh]
    for p in wrapped.parameters():
        p.grad = torch.zeros_like(p)
    assert loaded_optimizer.step()[0]


@pytest.mark.slow  # a pool case
def test_a_checkpoint_grouped_otherwise_loads_its_optimizer_state_by_name(pools, tmp_path):
    pools(4).run(_case_bare_checkpoint_into_the_wrapper, str(tmp_path / "ckpt"))
