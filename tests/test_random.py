"""RNG streams: what must match across ranks matches, what must differ differs,
and activation recompute replays dropout exactly."""

import pytest
import torch
import torch.distributed as dist

from helpers import full_grads, make_config, setup_parallel
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.models.common.embeddings import LanguageModelEmbedding
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.transformer import DotProductAttention


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _check_tp_distinct(per_rank: list[torch.Tensor], what: str) -> None:
    """Equal on ranks of the same TP rank (data-parallel replicas), different across TP ranks."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for a in range(len(per_rank)):
        for b in range(a + 1, len(per_rank)):
            same_tp_rank = a % tp == b % tp  # default order: TP varies fastest
            if same_tp_rank:
                assert torch.equal(per_rank[a], per_rank[b]), f"{what}: ranks {a} and {b} must match"
            else:
                assert not torch.equal(per_rank[a], per_rank[b]), f"{what}: ranks {a} and {b} must differ"


def _case_tracker_streams():
    setup_parallel(tp=2, seed=42)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    first = torch.rand(8)
    with tracker.fork():
        forked = torch.rand(8)
    second = torch.rand(8)
    for r in _gather(first) + _gather(second):
        assert torch.equal(r, first) or torch.equal(r, second)
    assert all(torch.equal(r, first) for r in _gather(first)), "default stream must match on every rank"
    _check_tp_distinct(_gather(forked), "model-parallel stream")
    # The fork leaves the default stream where it was.
    torch.random.default_generator.manual_seed(42)
    assert torch.equal(torch.rand(8), first) and torch.equal(torch.rand(8), second)
    # Forking again continues the tracked stream instead of restarting it.
    with tracker.fork():
        assert not torch.equal(torch.rand(8), forked)
    with pytest.raises(KeyError, match="not tracked"):
        with tracker.fork("no-such-stream"):
            pass
    with pytest.raises(ValueError, match="already tracked"):
        tracker.add("another", 42 + 2718 + parallel_state.get_tensor_model_parallel_rank())


def test_tracker_streams(pools):
    pools(4).run(_case_tracker_streams)


def _case_dropout_streams():
    setup_parallel(tp=2, seed=5)
    # Attention dropout acts on this rank's heads: it must differ across TP ranks.
    attention = DotProductAttention(make_config(attention_dropout=0.5)).train()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 2, 2, 8, generator=g) for _ in range(3))
    _check_tp_distinct(_gather(attention(q, k, v)), "attention dropout")

    # Without sequence parallelism the hidden states are replicated over TP:
    # their dropout must be identical on every TP rank.
    model = GPTModel(make_config(hidden_dropout=0.3, attention_dropout=0.3), vocab_size=64,
                     max_sequence_length=16).train()
    captured = []
    model.decoder.layers[0].register_forward_hook(lambda m, i, o: captured.append(o[0].detach()))
    ids = torch.randint(0, 64, (2, 16), generator=g)
    model(ids, torch.arange(16).expand(2, 16), None)
    outputs = _gather(captured[0])
    assert all(torch.equal(o, outputs[0]) for o in outputs), "replicated dropout differs across ranks"

    # Under sequence parallelism each rank owns different tokens: with identical
    # inputs on the two halves of the sequence, the dropout masks must differ.
    embedding = LanguageModelEmbedding(make_config(hidden_dropout=0.5, sequence_parallel=True), 64, 16,
                                       position_embedding_type="none").train()
    half = torch.randint(0, 64, (2, 8), generator=g)
    out = embedding(torch.cat([half, half], dim=1), None)
    assert out.shape == (8, 2, 32)
    assert (out == 0).any(), "dropout had no effect"
    _check_tp_distinct(_gather((out == 0).to(torch.uint8)), "sequence-parallel dropout mask")


def test_dropout_streams(pools):
    pools(4).run(_case_dropout_streams)


def _loss_and_grads(tp, sequence_parallel, **recompute):
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    cfg = make_config(num_layers=3, hidden_dropout=0.2, attention_dropout=0.2,
                      sequence_parallel=sequence_parallel, **recompute)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=16, position_embedding_type="rope").train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    loss = model(ids, None, None, labels=ids).sum()
    loss.backward()
    return loss.detach(), full_grads(model)


RECOMPUTE = {
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),
}


def _case_recompute_matches(sequence_parallel):
    setup_parallel(tp=2)
    loss, grads = _loss_and_grads(2, sequence_parallel)
    for name, recompute in RECOMPUTE.items():
        r_loss, r_grads = _loss_and_grads(2, sequence_parallel, **recompute)
        assert torch.equal(r_loss, loss), f"{name}: loss differs"
        for param in grads:
            assert torch.equal(r_grads[param], grads[param]), f"{name}: gradient of {param} differs"


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_replays_dropout(pools, sequence_parallel):
    pools(4).run(_case_recompute_matches, sequence_parallel)
