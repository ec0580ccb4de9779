"""The collectives the MoE dispatchers use, on 4 ranks: all_to_all and the uneven (split-size)
sequence-parallel gather and reduce-scatter, forward and backward; and the expert RNG stream's
seed (Megatron's seed + 1024 + 100 x EP rank + expert-TP rank)."""

import pytest
import torch
import torch.distributed as dist

from helpers import setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.tensor_parallel import all_to_all, get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron_fsdp.tensor_parallel import mappings

WORLD = 4


def _rows(src: int, dst: int, n: int) -> torch.Tensor:
    """n rows [src, dst, i]: where each row came from and was going."""
    return torch.tensor([[src, dst, i] for i in range(n)], dtype=torch.float32).reshape(n, 3)


def _case_all_to_all() -> None:
    group = dist.group.WORLD
    rank = dist.get_rank()
    sends = [(rank + j) % 3 for j in range(WORLD)]  # rows to rank j; some zero
    receives = [(i + rank) % 3 for i in range(WORLD)]
    x = torch.cat([_rows(rank, j, sends[j]) for j in range(WORLD)]).requires_grad_(True)
    y = all_to_all(group, x, receives, sends)
    assert torch.equal(y, torch.cat([_rows(i, rank, receives[i]) for i in range(WORLD)]))
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank))
    y.backward(grad)
    # The gradient of each row comes back from the rank that received it.
    back = [torch.randn((sum((i + j) % 3 for j in range(WORLD)), 3), generator=torch.Generator().manual_seed(i))
            for i in range(WORLD)]
    mine = [back[j][sum((k + j) % 3 for k in range(rank)):][:sends[j]] for j in range(WORLD)]
    assert torch.equal(x.grad, torch.cat(mine))
    even = torch.arange(8.0).view(8, 1) + 10 * rank
    assert torch.equal(all_to_all(group, even), torch.cat([torch.arange(2.0 * rank, 2.0 * rank + 2).view(2, 1)
                                                           + 10 * i for i in range(WORLD)]))
    with pytest.raises(ValueError, match="input_split_sizes must be 4 non-negative ints"):
        all_to_all(group, x, receives, sends[:2])


def test_all_to_all_with_uneven_splits(pools):
    pools(WORLD).run(_case_all_to_all)


def _case_uneven_gather_and_reduce_scatter() -> None:
    setup_parallel(WORLD)
    rank = parallel_state.get_tensor_model_parallel_rank()
    sizes = [2, 0, 3, 1]
    g = torch.Generator().manual_seed(0)
    everyone = [torch.randn(n, 5, generator=g) for n in sizes]
    grads = [torch.randn(sum(sizes), 5, generator=g) for _ in range(WORLD)]  # each rank's gradient
    start, stop = sum(sizes[:rank]), sum(sizes[:rank + 1])
    for tp_output_grad in (True, False):
        x = everyone[rank].clone().requires_grad_(True)
        y = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=tp_output_grad,
                                                          output_split_sizes=sizes)
        assert torch.equal(y, torch.cat(everyone))
        y.backward(grads[rank])
        expected = sum(grads)[start:stop] if tp_output_grad else grads[rank][start:stop]
        torch.testing.assert_close(x.grad, expected)
    full = grads[rank].clone().requires_grad_(True)
    z = mappings.reduce_scatter_to_sequence_parallel_region(full, input_split_sizes=sizes)
    torch.testing.assert_close(z, sum(grads)[start:stop])
    z.backward(everyone[rank])
    assert torch.equal(full.grad, torch.cat(everyone))
    with pytest.raises(ValueError, match="this rank holds 7 rows but output_split_sizes says"):
        mappings.gather_from_sequence_parallel_region(torch.zeros(7, 5), output_split_sizes=sizes)
    with pytest.raises(ValueError, match="output_split_sizes must be 4 non-negative ints"):
        mappings.gather_from_sequence_parallel_region(x, output_split_sizes=[1, 2])


def test_uneven_sequence_parallel_gather_and_reduce_scatter(pools):
    pools(WORLD).run(_case_uneven_gather_and_reduce_scatter)


def _case_expert_rng_seed(ep: int, etp: int) -> None:
    setup_parallel(1, seed=5, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    seed = 5 + 1024 + 100 * parallel_state.get_expert_model_parallel_rank() \
        + parallel_state.get_expert_tensor_parallel_rank()
    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
        drawn = torch.rand(4)
    assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(seed)))
    return drawn.tolist()


@pytest.mark.parametrize("ep, etp", [(2, 2), (4, 1)])
def test_expert_rng_stream_is_seeded_per_expert_rank(pools, ep, etp):
    drawn = pools(WORLD).run(_case_expert_rng_seed, ep, etp)
    assert len({tuple(d) for d in drawn}) == WORLD  # every (EP, expert TP) rank its own stream
