"""Context-parallel attention (megatron_fsdp.transformer.cp_attention) against the one-process
causal attention of the whole sequence: outputs and gradients of q, k and v, each rank holding
Megatron's two load-balanced chunks; and the split against Megatron-Core's own."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from helpers import setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.transformer import cp_attention
from megatron_fsdp.utils import split_for_cp_rank

B, D, CHUNK = 2, 8, 3


def _whole(seed: int, heads: int, seq: int) -> torch.Tensor:
    return torch.randn(B, heads, seq, D, generator=torch.Generator().manual_seed(seed))


def _reference(hq: int, hkv: int, seq: int):
    q, k, v = (_whole(s, h, seq).requires_grad_() for s, h in ((1, hq), (2, hkv), (3, hkv)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=hq != hkv)
    (out * _whole(4, hq, seq)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _case_matches_the_whole_sequence(comm_type: str, hq: int, hkv: int):
    size = dist.get_world_size()
    setup_parallel(1, context_parallel_size=size)
    group, rank = parallel_state.get_context_parallel_group(), parallel_state.get_context_parallel_rank()
    seq = 2 * size * CHUNK
    expected = _reference(hq, hkv, seq)
    split = [split_for_cp_rank(t, 2, size, rank) for t in expected]
    q, k, v = (split_for_cp_rank(_whole(s, h, seq), 2, size, rank).requires_grad_()
               for s, h in ((1, hq), (2, hkv), (3, hkv)))
    out = cp_attention.context_parallel_attention(q, k, v, group, comm_type, scale=0.3)
    (out * split_for_cp_rank(_whole(4, hq, seq), 2, size, rank)).sum().backward()
    for name, got, want in zip(("output", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), split):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{comm_type} {name}: {m}")
    return True


@pytest.mark.parametrize("comm_type", ["all_gather", "a2a"])
@pytest.mark.parametrize("world_size,hq,hkv", [(2, 4, 2), (4, 4, 4), pytest.param(4, 8, 4, marks=pytest.mark.slow)])
def test_context_parallel_attention_is_the_whole_sequences(pools, comm_type, world_size, hq, hkv):
    assert pools(world_size).run(_case_matches_the_whole_sequence, comm_type, hq, hkv) == [True] * world_size


def _case_hierarchical_matches_the_whole_sequence(sizes: tuple, hq: int, hkv: int):
    size = dist.get_world_size()
    setup_parallel(1, context_parallel_size=size, hierarchical_context_parallel_sizes=list(sizes))
    groups = parallel_state.get_hierarchical_context_parallel_groups()
    a2a, p2p = (dist.get_process_group_ranks(g) for g in groups)
    # Megatron's layout (create_hierarchical_groups): a2a groups of neighbours, p2p rings a2a-size apart.
    rank = dist.get_rank()
    assert a2a == list(range(rank - rank % sizes[0], rank - rank % sizes[0] + sizes[0])), a2a
    assert p2p == list(range(rank % sizes[0], size, sizes[0])), p2p
    rank = parallel_state.get_context_parallel_rank()
    seq = 2 * size * CHUNK
    expected = _reference(hq, hkv, seq)
    split = [split_for_cp_rank(t, 2, size, rank) for t in expected]
    q, k, v = (split_for_cp_rank(_whole(s, h, seq), 2, size, rank).requires_grad_()
               for s, h in ((1, hq), (2, hkv), (3, hkv)))
    out = cp_attention.context_parallel_attention(q, k, v, groups, "a2a+p2p", scale=0.3)
    (out * split_for_cp_rank(_whole(4, hq, seq), 2, size, rank)).sum().backward()
    for name, got, want in zip(("output", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), split):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"a2a+p2p {sizes} {name}: {m}")
    return True


@pytest.mark.parametrize("sizes,hq,hkv", [((2, 2), 4, 2), pytest.param((4, 1), 4, 4, marks=pytest.mark.slow),
                                          pytest.param((1, 4), 2, 1, marks=pytest.mark.slow)])
def test_hierarchical_a2a_p2p_attention_is_the_whole_sequences(pools, sizes, hq, hkv):
    """a2a+p2p at CP 4: Ulysses within each a2a group, the ring across; (4, 1) is plain a2a and
    (1, 4) the plain ring, both reached through the hierarchy."""
    assert pools(4).run(_case_hierarchical_matches_the_whole_sequence, sizes, hq, hkv) == [True] * 4


def _case_a2a_refuses_heads_that_do_not_divide():
    setup_parallel(1, context_parallel_size=dist.get_world_size())
    q = torch.zeros(1, 2, 4, D)
    cp_attention.a2a_attention(q, q[:, :1], q[:, :1], parallel_state.get_context_parallel_group(), scale=1.0)


def test_a2a_needs_heads_divisible_by_the_context_parallel_size(pools):
    errors = pools(2).run_expecting_errors(_case_a2a_refuses_heads_that_do_not_divide)
    assert all("divisible by --context-parallel-size (2)" in e.message for e in errors), errors[0].message


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_the_split_is_megatron_cores(cp_size):
    """Megatron-Core's _get_batch_on_this_cp_rank_per_sequence_balancing, in its own words: the
    sequence in 2 x CP chunks, rank r keeping chunks r and 2CP-1-r; the positions alike."""
    seq = 2 * cp_size * 3
    tokens = torch.arange(2 * seq).view(2, seq)
    for rank in range(cp_size):
        got = split_for_cp_rank(tokens, 1, cp_size, rank)
        chunks = tokens.view(2, 2 * cp_size, -1)
        want = torch.cat([chunks[:, rank], chunks[:, 2 * cp_size - 1 - rank]], dim=1)
        assert torch.equal(got, want)
        assert torch.equal(cp_attention.positions_of_rank(seq // cp_size, cp_size, rank), want[0])
    with pytest.raises(ValueError, match="cannot be split in 2 x context parallel size"):
        split_for_cp_rank(torch.zeros(1, 2 * cp_size * 3 + 1), 1, 2, 0)


def _case_dropout_masks_differ_between_cp_ranks(comm_type: str):
    size = dist.get_world_size()
    hierarchical = comm_type == "a2a+p2p"
    setup_parallel(1, context_parallel_size=size, hierarchical_context_parallel_sizes=[2, 1] if hierarchical else None)
    group = (parallel_state.get_hierarchical_context_parallel_groups() if hierarchical
             else parallel_state.get_context_parallel_group())
    torch.manual_seed(7)  # every CP rank the same generator state, as in training
    # Every head the same: a head's output differs from another's only by its dropout mask.
    one = torch.randn(B, 1, 4 * size, D, generator=torch.Generator().manual_seed(1))
    q = k = v = one.expand(B, 4, 4 * size, D).contiguous()
    out = cp_attention.context_parallel_attention(q, k, v, group, comm_type, scale=0.3, dropout_p=0.5)
    return [not torch.equal(out[:, 0], out[:, h]) for h in range(1, 4)]


@pytest.mark.parametrize("comm_type", ["a2a", "a2a+p2p"])
def test_attention_dropout_masks_differ_between_cp_ranks(pools, comm_type):
    """a2a: CP rank r draws the masks of heads [rH/P, (r+1)H/P) for the whole sequence; drawn from
    the same generator on every rank, head 0's and head 2's would be identical (at P = 2)."""
    assert all(all(differs) for differs in pools(2).run(_case_dropout_masks_differ_between_cp_ranks, comm_type))
