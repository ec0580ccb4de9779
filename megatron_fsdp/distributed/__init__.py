"""Data parallelism: Megatron-Core's configs and the FSDP2 wrapper."""

from .data_parallel_base import _BaseDataParallel
from .distributed_data_parallel_config import DistributedDataParallelConfig, TorchFullyShardedDataParallelConfig
from .finalize_model_grads import finalize_model_grads
from .torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

__all__ = [
    "DistributedDataParallelConfig",
    "TorchFullyShardedDataParallel",
    "TorchFullyShardedDataParallelConfig",
    "_BaseDataParallel",
    "finalize_model_grads",
]
