"""Megatron's per-parameter TP attributes on our layers and the helpers that
read them, plus the 1D split/gather helpers and VocabUtility."""

import pytest
import torch
import torch.distributed as dist

from helpers import make_config, setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    gather_split_1d_tensor,
    local_tensor,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    split_tensor_into_1d_equal_chunks,
)
from megatron_fsdp.tensor_parallel.utils import VocabUtility
from megatron_fsdp.transformer.utils import init_method_normal

WORLD = 4
MEGATRON_ATTRIBUTES = ("expert_tp", "is_qkv", "qkv_split_shapes", "tensor_model_parallel", "partition_dim",
                       "partition_stride")


def _case_attributes(tp: int) -> None:
    setup_parallel(tp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cfg = make_config()
    init = init_method_normal(0.02)
    column = ColumnParallelLinear(16, 8, config=cfg, init_method=init, bias=True)
    row = RowParallelLinear(8, 16, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                            skip_bias_add=False)
    embedding = VocabParallelEmbedding(64, 16, init_method=init, config=cfg)
    # (tensor_model_parallel, partition_dim, partition_stride): Megatron's values, at every TP size.
    expected = {"column.weight": (column.weight, (True, 0, 1)), "column.bias": (column.bias, (True, 0, 1)),
                "row.weight": (row.weight, (True, 1, 1)), "row.bias": (row.bias, (False, -1, 1)),
                "embedding.weight": (embedding.weight, (True, 0, 1))}
    for name, (param, attributes) in expected.items():
        got = (param.tensor_model_parallel, param.partition_dim, param.partition_stride)
        assert got == attributes, f"{name}: {got}"
        assert param_is_not_tensor_parallel_duplicate(param) == (attributes[0] or tp_rank == 0), name
    assert (embedding.vocab_start_index, embedding.vocab_end_index) == (tp_rank * 64 // tp, (tp_rank + 1) * 64 // tp)

    # The use Megatron puts the helper to (grad norms, parameter counts): over
    # a TP group, the non-duplicate local parts of a model add up to the model.
    model = GPTModel(make_config(), vocab_size=64, max_sequence_length=16)
    counted = torch.tensor(sum(local_tensor(p).numel() for p in model.parameters()
                               if param_is_not_tensor_parallel_duplicate(p)))
    dist.all_reduce(counted, group=parallel_state.get_tensor_model_parallel_group())
    assert counted.item() == sum(p.numel() for p in model.parameters())

    # An explicit group decides which rank counts a replicated parameter;
    # expert_tp_group does for a parameter Megatron marks allreduce=False.
    alone = parallel_state.get_pipeline_model_parallel_group()  # this rank alone: its rank 0
    assert param_is_not_tensor_parallel_duplicate(row.bias, tp_group=alone)
    expert = torch.nn.Parameter(torch.zeros(2))
    expert.allreduce = False
    assert param_is_not_tensor_parallel_duplicate(expert, expert_tp_group=alone)
    assert param_is_not_tensor_parallel_duplicate(expert) == (tp_rank == 0)

    set_defaults_if_not_set_tensor_model_parallel_attributes(expert)
    assert [getattr(expert, a) for a in MEGATRON_ATTRIBUTES] == [False, False, None, False, -1, 1]
    copy = torch.nn.Parameter(torch.zeros(2))
    copy_tensor_model_parallel_attributes(copy, column.weight)
    assert (copy.tensor_model_parallel, copy.partition_dim, copy.partition_stride) == (True, 0, 1)


def _case_split_and_gather_1d(tp: int) -> None:
    setup_parallel(tp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    full = torch.arange(24.0).view(4, 6)
    chunk = split_tensor_into_1d_equal_chunks(full)
    assert torch.equal(chunk, torch.arange(24.0).chunk(tp)[tp_rank])
    assert chunk.data_ptr() == full.view(-1)[tp_rank * 24 // tp].data_ptr()  # a view
    copied = split_tensor_into_1d_equal_chunks(full, new_buffer=True)
    assert torch.equal(copied, chunk) and copied.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
    assert torch.equal(gather_split_1d_tensor(chunk), full.view(-1))
    if tp > 1:
        with pytest.raises(ValueError, match=f"25 elements are not divisible by the tensor-parallel size {tp}"):
            split_tensor_into_1d_equal_chunks(torch.zeros(25))


@pytest.mark.parametrize("tp", [1, 2])
def test_layer_attributes_and_duplicates(pools, tp):
    pools(WORLD).run(_case_attributes, tp)


@pytest.mark.parametrize("tp", [1, 4])
def test_split_and_gather_1d(pools, tp):
    pools(WORLD).run(_case_split_and_gather_1d, tp)


def test_vocab_utility():
    assert VocabUtility.vocab_range_from_global_vocab_size(64, 1, 4) == (16, 32)
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(16, 3, 4) == (48, 64)
    with pytest.raises(ValueError, match="63 is not divisible by 4"):
        VocabUtility.vocab_range_from_global_vocab_size(63, 0, 4)
