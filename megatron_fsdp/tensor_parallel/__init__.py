"""Tensor parallelism: layers, communication mappings, cross entropy and RNG."""

from . import random
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
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
    model_parallel_cuda_manual_seed,
)
from .utils import divide, local_tensor

__all__ = [
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "checkpoint",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "get_cuda_rng_tracker",
    "local_tensor",
    "model_parallel_cuda_manual_seed",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "vocab_parallel_cross_entropy",
]
