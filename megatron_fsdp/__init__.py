"""megatron_fsdp: Megatron-Core-style model parallelism on PyTorch FSDP2.

Also NVIDIA Megatron-FSDP's public API for any model (`fully_shard`,
`fully_shard_model`, `fully_shard_optimizer`, `MegatronFSDP`,
`MixedPrecisionPolicy`), loaded on first use: `import megatron_fsdp` alone
does not load the FSDP stack.
"""

import importlib
import sys
import types

from . import parallel_state, tensor_parallel
from .model_parallel_config import ModelParallelConfig

__version__ = "0.1.0"

_LAZY = {
    "fully_shard": "fully_shard",
    "fully_shard_model": "fully_shard",
    "fully_shard_optimizer": "fully_shard",
    "MegatronFSDP": "megatron_fsdp",
    "MixedPrecisionPolicy": "mixed_precision",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """`megatron_fsdp.fully_shard` is the function, as in NVIDIA's package, although a submodule
    of that name exists: importing the submodule would otherwise bind the module over it."""

    def __setattr__(self, name, value):
        if name == "fully_shard" and isinstance(value, types.ModuleType):
            value = value.fully_shard
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = ["ModelParallelConfig", "parallel_state", "tensor_parallel", "__version__", *_LAZY]
