"""Applying fp8 to a model: which linears run fp8, fp8 training weights, and
the checks that go with fp8 weight all-gather."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import _torch_compat
from .recipe import Fp8Recipe, layer_runs_fp8
from .weight import Fp8TrainingWeight, Fp8WeightMeta, is_fp8_training_weight


def _fp8_linears(module: nn.Module):
    """(name, module) of every parallel linear that runs fp8 GEMMs."""
    return [(name, m) for name, m in module.named_modules() if getattr(m, "fp8_state", None) is not None]


def configure_fp8_layer(layer: nn.Module, config, layer_no: int) -> int:
    """Turn on fp8 GEMMs in every parallel linear of transformer layer
    `layer_no` (0-based) when the config says that layer runs fp8; returns how many."""
    if not layer_runs_fp8(config, layer_no):
        return 0
    recipe = Fp8Recipe.from_config(config)
    linears = [m for m in layer.modules() if callable(getattr(m, "enable_fp8", None))]
    for m in linears:
        m.enable_fp8(recipe)
    return len(linears)


def check_fp8_param_gather(config, ddp_config, reshard_after_forward) -> None:
    """Raise for a combination fp8 weight all-gather cannot serve; a no-op
    without `ddp_config.fp8_param_gather` and `config.fp8_param`. Checks
    configuration only (no communication): every rank raises alike."""
    if not getattr(ddp_config, "fp8_param_gather", False):
        if getattr(config, "fp8_param", False):
            raise ValueError("fp8_param=True needs DistributedDataParallelConfig(fp8_param_gather=True) "
                             "(Megatron's --fp8-param-gather sets both)")
        return
    if getattr(config, "fp8", None) is None:
        raise ValueError("fp8_param_gather=True needs fp8 training: set TransformerConfig.fp8 "
                         "(--fp8-format) to 'e4m3' or 'hybrid'")
    check_fp8_reshard(reshard_after_forward)


def check_fp8_reshard(reshard_after_forward) -> None:
    """The one check of fp8 all-gather against FSDP's resharding (the DDP config runs it when
    built, the wrapper again for a config changed since)."""
    if not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fp8_param_gather=True with reshard_after_forward={reshard_after_forward!r} is not supported: "
            "FSDP2's all-gather extensions cannot reshard to a smaller group; use True or False")


def _plain_master_weight(value):
    if isinstance(value, DTensor) and isinstance(_torch_compat.local_tensor(value), Fp8TrainingWeight):
        return DTensor.from_local(_torch_compat.local_tensor(value)._data, value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, Fp8TrainingWeight):
        return value._data
    return value


def _save_plain_weight(module, state_dict, prefix, local_metadata):
    # Checkpoints hold the master weight as a plain tensor (same storage): a
    # run with or without fp8 loads it, and DCP writes plain bytes.
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = _plain_master_weight(state_dict[key])


def _to_fp8_training_weight(weight: nn.Parameter, recipe: Fp8Recipe) -> nn.Parameter:
    meta = Fp8WeightMeta(recipe.forward_dtype, recipe.margin)
    if isinstance(weight, DTensor):
        local = Fp8TrainingWeight(_torch_compat.local_tensor(weight).detach(), meta)
        value = DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                                   shape=weight.shape, stride=weight.stride())
    else:
        value = Fp8TrainingWeight(weight.detach(), meta)
    new = nn.Parameter(value, requires_grad=weight.requires_grad)
    # Megatron's per-parameter attributes (tensor_model_parallel, partition_dim, ...).
    for name, attr in vars(weight).items():
        if not name.startswith("_"):
            setattr(new, name, attr)
    return new


def convert_to_fp8_weights(module: nn.Module) -> int:
    """Before fully_shard: make the weight of every parallel linear that runs
    fp8 an fp8 training weight (same values, same DTensor layout and
    attributes); returns how many weights this call converted.

    Works on a model built on the meta device too: the weights stay on meta
    until materialized. Either way call `refresh_fp8_scales(module)` once the
    weights hold their values (after materialization and initialization, or
    a checkpoint load) and before the first forward.
    """
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError("convert_to_fp8_weights must run before fully_shard: the module is already sharded")
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    converted = 0
    for name, linear in _fp8_linears(module):
        weight = getattr(linear, "weight", None)
        if weight is None or is_fp8_training_weight(weight):
            continue
        if uses[id(weight)] > 1:
            raise ValueError(f"convert_to_fp8_weights: {name}.weight is shared with another module; a shared "
                             "weight cannot be an fp8 training weight (keep that layer in high precision)")
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"convert_to_fp8_weights: {name}.weight is {weight.dtype}; fp8 training weights "
                             "keep a float32/bfloat16/float16 master")
        linear.weight = _to_fp8_training_weight(weight, linear.fp8_state.recipe)
        linear.fp8_state.converted_weight = True
        if not getattr(linear, "_fp8_state_dict_hook", False):
            linear.register_state_dict_post_hook(_save_plain_weight)
            linear._fp8_state_dict_hook = True
        converted += 1
    return converted
