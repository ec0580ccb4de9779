"""Resuming across TP sizes with a padded vocabulary: 128 tokens are 256 rows
at TP=2, 128 at TP=1 and 512 at TP=4 (make_vocab_size_divisible_by=128)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import full_tensor, make_config, setup_parallel, tiered
from megatron_fsdp import parallel_state
from megatron_fsdp.dist_checkpointing import torch_dcp
from megatron_fsdp.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training.checkpointing import CheckpointError, load_checkpoint, save_checkpoint

VOCAB = 128
DIVISIBLE_BY = 128
SEQ = 16
ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _padded(tp):
    return int(math.ceil(VOCAB / (DIVISIBLE_BY * tp)) * DIVISIBLE_BY * tp)


def _build(tp):
    setup_parallel(tp)
    cfg = make_config(sequence_parallel=tp > 1)
    model = GPTModel(cfg, vocab_size=_padded(tp), max_sequence_length=SEQ, position_embedding_type="rope")
    model = TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, adam_eps=1e-5), model)
    return model, optimizer


def _batch(step):
    ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def _true_vocab_loss(model):
    """Cross entropy over the true vocabulary (the padded logits are not
    tokens), on the same full batch on every rank."""
    tokens, labels = _batch(0)
    with torch.no_grad():
        logits = model(tokens, None, None, runtime_gather_output=True)
    return F.cross_entropy(logits[..., :VOCAB].float().reshape(-1, VOCAB), labels.reshape(-1)).item()


def _vocab_state(model, optimizer):
    """Full weights and Adam moments of the vocabulary-row parameters (a collective)."""
    opt_state = torch_dcp.sharded_state(model, optimizer)["optimizer"]["state"]
    params = dict(model.module.named_parameters())
    return {name: {"weight": full_tensor(params[name].detach()).clone(),
                   **{k: full_tensor(opt_state[name][k]).clone() for k in ("exp_avg", "exp_avg_sq")}}
            for name in ROWS}


def _case_save(ckpt):
    model, optimizer = _build(2)
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    for step in range(1, 3):
        tokens, labels = _batch(step)
        rows = slice(rank * 4 // dp, (rank + 1) * 4 // dp)
        model(tokens[rows], None, None, labels=labels[rows]).mean().backward()
        model.finish_grad_sync()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(2, model, optimizer, None, ckpt, true_vocab_size=VOCAB)
    return _true_vocab_loss(model), _vocab_state(model, optimizer)


def _case_load(ckpt, tp):
    model, optimizer = _build(tp)
    if tp == 1:
        with pytest.raises(CheckpointError, match=r"word_embeddings.weight: checkpoint has shape \[256, 32\], "
                                                  r"model has \[128, 32\] \(another vocabulary padding: "
                                                  r"pass true_vocab_size= to load_checkpoint; the checkpoint.s is 128"):
            load_checkpoint(model, optimizer, None, ckpt)  # shapes must match without the true vocabulary
        with pytest.raises(CheckpointError, match="saved with a vocabulary of 128 tokens, the model has 100"):
            load_checkpoint(model, optimizer, None, ckpt, true_vocab_size=100)
    load_checkpoint(model, optimizer, None, ckpt, true_vocab_size=VOCAB)
    return _true_vocab_loss(model), _vocab_state(model, optimizer)


@pytest.fixture(scope="module")
def saved(pools, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("vocab"))
    loss, state = pools(4).run(_case_save, ckpt)[0]
    return ckpt, loss, state


@pytest.mark.parametrize("world_size,tp", tiered([(2, 1), (1, 1), (4, 4)], [(1, 1)]))
def test_load_across_vocabulary_padding(pools, saved, world_size, tp):
    ckpt, loss_before, before = saved
    loss, after = pools(world_size).run(_case_load, ckpt, tp)[0]
    assert math.isclose(loss, loss_before, rel_tol=1e-5), f"loss {loss} after loading, {loss_before} before saving"
    for name in ROWS:
        for key in ("weight", "exp_avg", "exp_avg_sq"):
            got, want = after[name][key], before[name][key]
            assert got.shape[0] == _padded(tp), (name, key, got.shape)
            torch.testing.assert_close(got[:VOCAB], want[:VOCAB], rtol=0, atol=0,
                                       msg=lambda m: f"{name} {key}: rows of the true vocabulary differ\n{m}")
            # Padding rows are zero-filled, whatever the model was initialized with.
            assert not got[VOCAB:].any(), f"{name} {key}: padding rows are not zero"
