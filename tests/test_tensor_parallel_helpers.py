"""Megatron's tensor-parallel helpers: parameter attributes, splitting, broadcast_data."""

import pytest
import torch

from helpers import make_config, setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_fsdp.transformer.utils import init_method_normal


def _case_megatron_tp_helpers() -> None:
    from megatron_fsdp.tensor_parallel import (
        broadcast_data,
        param_is_not_tensor_parallel_duplicate,
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
        split_tensor_along_last_dim,
    )

    setup_parallel(2)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    column = ColumnParallelLinear(16, 8, config=make_config(), init_method=init_method_normal(0.02), bias=True)
    row = RowParallelLinear(8, 16, config=make_config(), init_method=init_method_normal(0.02), bias=True,
                            input_is_parallel=True, skip_bias_add=False)
    assert (column.weight.tensor_model_parallel, column.weight.partition_dim, column.weight.partition_stride) == (
        True, 0, 1)
    assert row.weight.partition_dim == 1 and row.bias.tensor_model_parallel is False
    # A TP-split weight counts on every rank; a replicated bias on TP rank 0 only.
    assert param_is_not_tensor_parallel_duplicate(column.weight)
    assert param_is_not_tensor_parallel_duplicate(row.bias) == (tp_rank == 0)
    plain = torch.nn.Parameter(torch.zeros(3))
    set_defaults_if_not_set_tensor_model_parallel_attributes(plain)
    assert (plain.tensor_model_parallel, plain.partition_dim, plain.partition_stride) == (False, -1, 1)
    with pytest.raises(ValueError, match="tensor_model_parallel is already set"):
        set_tensor_model_parallel_attributes(plain, True, 0, 1)

    parts = split_tensor_along_last_dim(torch.arange(12.0).view(2, 6), 3, contiguous_split_chunks=True)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    with pytest.raises(ValueError, match="6 is not divisible by 4"):
        split_tensor_along_last_dim(torch.zeros(2, 6), 4)

    # broadcast_data: TP rank 0's batch reaches its TP peer, whatever the peer holds.
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = {"tokens": torch.full((2, 3), 10 * dp_rank + tp_rank, dtype=torch.int64),
            "labels": torch.arange(4, dtype=torch.int64).view(1, 4) + dp_rank}
    got = broadcast_data(["tokens", "labels"], mine if tp_rank == 0 else None, torch.int64)
    assert torch.equal(got["tokens"], torch.full((2, 3), 10 * dp_rank))
    assert torch.equal(got["labels"], torch.arange(4).view(1, 4) + dp_rank)
    bad = {"tokens": torch.zeros(2, dtype=torch.float32)}
    with pytest.raises(ValueError, match="broadcast_data"):
        broadcast_data(["tokens"], bad, torch.int64)


def test_megatron_tensor_parallel_helpers(pools):
    pools(4).run(_case_megatron_tp_helpers)
