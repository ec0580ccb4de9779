"""Initialize a model that was built on the meta device.

Every megatron_fsdp layer records how it draws each parameter (see
tensor_parallel.utils.record_init). `initialize_parameters` replays those
draws in construction order, each as a full tensor from the same generator,
and writes every rank's part of it into the parameter however it is sharded
(TP, FSDP or both). With the generator in the state a normal build starts
from, the result is bit-for-bit the normally built model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .tensor_parallel.utils import init_full_tensor


def _unrecorded_parameters(model: nn.Module) -> list[str]:
    recorded = {id(getattr(m, name)) for m in model.modules()
                for name in getattr(m, "_megatron_param_init", {})}
    return [name for name, p in model.named_parameters() if id(p) not in recorded]


@torch.no_grad()
def initialize_parameters(model: nn.Module) -> None:
    """Draw every parameter's initial value again, in the order a build draws them.

    Seed first as before a normal build (e.g.
    `tensor_parallel.model_parallel_cuda_manual_seed(seed)`). Raises if the
    model holds a parameter whose initialization is unknown.
    """
    missing = _unrecorded_parameters(model)
    if missing:
        raise ValueError(
            f"cannot initialize parameters not created by megatron_fsdp layers: {missing[:5]}"
            + (" ..." if len(missing) > 5 else "")
        )
    for module in model.modules():
        for name, (init_method, config) in getattr(module, "_megatron_param_init", {}).items():
            param = getattr(module, name)
            if param.device.type == "meta":
                raise ValueError(f"parameter {name} of {type(module).__name__} is still on the meta "
                                 "device: call model.to_empty(device=...) first")
            full = init_full_tensor(tuple(param.shape), init_method, config)
            if isinstance(param, DTensor):
                full = full.to(param.device_mesh.device_type)
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)
        reset_buffers = getattr(module, "reset_buffers", None)
        if callable(reset_buffers):
            reset_buffers()
