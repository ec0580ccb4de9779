"""megatron_fsdp: Megatron-Core-style model parallelism on PyTorch FSDP2."""

from . import parallel_state, tensor_parallel
from .model_parallel_config import ModelParallelConfig

__version__ = "0.1.0"

__all__ = ["ModelParallelConfig", "parallel_state", "tensor_parallel", "__version__"]
