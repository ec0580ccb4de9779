"""Tensor parallelism: layers, communication mappings, cross entropy and RNG."""

from . import random
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .random import (
    CudaRNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
    model_parallel_cuda_manual_seed,
)
from .data import broadcast_data
from .utils import (
    copy_tensor_model_parallel_attributes,
    divide,
    gather_split_1d_tensor,
    local_tensor,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)

__all__ = [
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "all_to_all",
    "broadcast_data",
    "checkpoint",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "gather_split_1d_tensor",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "get_expert_parallel_rng_tracker_name",
    "local_tensor",
    "model_parallel_cuda_manual_seed",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "vocab_parallel_cross_entropy",
]
