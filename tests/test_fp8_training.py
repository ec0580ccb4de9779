"""fp8 end to end: a small GPT trained through TorchFullyShardedDataParallel at
TP=2 x DP=2 with fp8 GEMMs and fp8 weight all-gather learns as bf16 does, and a
checkpoint taken mid-run resumes exactly where an uninterrupted run goes."""

import pytest
import torch

from helpers import make_config, setup_parallel
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training.checkpointing import load_checkpoint, save_checkpoint

VOCAB, SEQ, MICRO, STEPS = 64, 32, 4, 16  # 16 steps: the loss falls to 0.44 of its start
FP8 = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max")


def _build(fp8: bool):
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    cfg = make_config(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, bf16=True,
                      sequence_parallel=True, **(FP8 if fp8 else {}))
    model = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(fp8_param_gather=fp8),
                                          GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ))
    return model, get_megatron_optimizer(OptimizerConfig(lr=3e-3, bf16=True, clip_grad=1.0), model)


def _batch(step: int):
    # A fixed pool of 16 sequences with a learnable next-token rule (x -> 3x + 1
    # mod VOCAB), so the loss falls far in a few dozen steps.
    dp_rank = parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(step % 4 * 100 + dp_rank)
    start = torch.randint(0, VOCAB, (MICRO, 1), generator=g)
    ids = [start]
    for _ in range(SEQ):
        ids.append((ids[-1] * 3 + 1) % VOCAB)
    ids = torch.cat(ids, dim=1)
    return ids[:, :-1], ids[:, 1:]


def _train(model, optimizer, steps):
    losses = []
    for step in steps:
        ids, labels = _batch(step)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model(ids, torch.arange(SEQ).expand(MICRO, SEQ), None, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok
        losses.append(loss.item())
    return losses


def _case_curves():
    setup_parallel(2)
    return {name: _train(*_build(fp8), range(STEPS)) for name, fp8 in (("bf16", False), ("fp8", True))}


@pytest.mark.slow  # about 20 s on 2 cores: 16 steps of a TP2 x DP2 GPT, twice
def test_fp8_with_fp8_all_gather_learns_like_bf16(pools):
    curves = pools(4).run(_case_curves)[0]
    bf16, fp8 = (sum(curves[name][-5:]) / 5 for name in ("bf16", "fp8"))
    assert curves["fp8"][0] > 3.5 and fp8 < 0.5 * curves["fp8"][0], curves["fp8"]  # it learns
    assert abs(fp8 - bf16) <= 0.03 * bf16, (fp8, bf16)


RESUME_AT = 8  # twice the history length: the histories hold only recorded amaxes


def _case_resume(save_dir):
    setup_parallel(2)
    model, optimizer = _build(True)
    first = _train(model, optimizer, range(RESUME_AT))
    save_checkpoint(RESUME_AT, model, optimizer, None, save_dir)
    uninterrupted = first + _train(model, optimizer, range(RESUME_AT, RESUME_AT + 3))
    del model, optimizer
    model, optimizer = _build(True)
    loaded = load_checkpoint(model, optimizer, None, save_dir)
    assert loaded["iteration"] == RESUME_AT
    resumed = _train(model, optimizer, range(RESUME_AT, RESUME_AT + 3))
    return uninterrupted, first + resumed


@pytest.mark.slow  # about 15 s on 2 cores
def test_fp8_checkpoint_resumes_exactly(pools, tmp_path):
    uninterrupted, resumed = pools(4).run(_case_resume, str(tmp_path))[0]
    # Master weights, optimizer state and the delayed-scaling histories come back:
    # the resumed steps are the uninterrupted ones, bit for bit.
    assert resumed == pytest.approx(uninterrupted, rel=0, abs=0)
