"""Gradient norms and zero counts count every element once, however the gradient is split."""

import math

import pytest
import torch

from helpers import batch, full_tensor, make_config, setup_parallel
from megatron_fsdp.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import (
    OptimizerConfig,
    clip_grad_norm_,
    count_zeros_fp32,
    get_grad_norm_fp32,
    get_megatron_optimizer,
)


def _full_grad_vector(model) -> torch.Tensor:
    return torch.cat([full_tensor(p.grad).reshape(-1) for p in model.parameters()])


def _case_grad_norm(tp, fsdp):
    setup_parallel(tp)
    cfg = make_config(sequence_parallel=tp > 1)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=16)
    if fsdp:
        model = TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(), model)
    ids, labels, positions, weights = batch(64)
    (model(ids, positions, None, labels=labels) * weights).sum().backward()
    dense = _full_grad_vector(model)
    grads = [p.grad for p in model.parameters()]
    torch.testing.assert_close(torch.tensor(get_grad_norm_fp32(grads)), dense.norm(), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(get_grad_norm_fp32(grads, math.inf)), dense.abs().max(),
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(get_grad_norm_fp32(grads, 1)), dense.abs().sum(), rtol=1e-5, atol=0)
    max_norm = 0.5 * dense.norm().item()
    returned = clip_grad_norm_(model.parameters(), max_norm)
    torch.testing.assert_close(torch.tensor(returned), dense.norm(), rtol=1e-5, atol=0)
    clipped = _full_grad_vector(model)
    torch.testing.assert_close(clipped, dense * (max_norm / (dense.norm().item() + 1e-6)), rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="max_norm must be positive, got 0"):
        clip_grad_norm_(model.parameters(), 0)

    # Embedding rows of tokens absent from the batch have zero gradients.
    expected_zeros = int((dense == 0).sum())
    assert expected_zeros > 0
    assert count_zeros_fp32(model.parameters()) == expected_zeros
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, clip_grad=1.0, log_num_zeros_in_grad=True), model)
    _, _, num_zeros = optimizer.step()
    assert num_zeros == expected_zeros, f"num_zeros_in_grad {num_zeros}, full gradient has {expected_zeros}"


@pytest.mark.parametrize("tp,fsdp", [(1, False), (2, False), (4, False), (1, True), (2, True)])
def test_grad_norm_matches_dense(pools, tp, fsdp):
    pools(4).run(_case_grad_norm, tp, fsdp)
