"""The one place fp8 enters a model: the converter.

`convert_to_fp8(model, config)` turns every column- and row-parallel linear
of every TransformerLayer that the config runs in fp8 (all of them, less the
first/last layers under `first_last_layers_bf16`) into its fp8 subclass,
in place: the same module object, parameters and hooks, with a class whose
`_matmul` runs `fp8_linear` and which holds the layer's `fp8_state`. Nothing
else in the model knows fp8. The FSDP plan applies the converter (with
`convert_to_fp8_weights` for fp8 weight all-gather); a model run without the
wrapper is converted by its owner (pretrain() does it), and GPTModel refuses
to run with `config.fp8` set and no conversion.
"""

from __future__ import annotations

import io
from collections import Counter
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .. import _torch_compat, parallel_state
from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..transformer.transformer_layer import TransformerLayer
from ..utils import register_post_step_hook, register_weights_changed_hook
from .gemm import check_rowwise_support
from .linear import Fp8LinearState, _fp8_linears, check_fp8_weight_shape, fp8_linear
from .recipe import Fp8Recipe, layer_runs_fp8
from .refresh import refresh_fp8_scales, refresh_fp8_weight_scales
from .weight import Fp8TrainingWeight, Fp8WeightMeta, is_fp8_training_weight


class Fp8Linear:
    """Mixed in ahead of a parallel linear's class by the converter: its local
    GEMMs run in fp8 (`fp8_linear`; the bias is added in high precision)."""

    fp8_state: Fp8LinearState

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = fp8_linear(x, weight, self.fp8_state)
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8={self.fp8_state.recipe.format}"

    # The delayed-scaling histories are module state (torch's extra state), so they
    # travel in the model's state dict and thus in its DCP checkpoints, under
    # "<linear>._extra_state". Serialized (Transformer Engine's convention): DCP
    # stores the bytes once (the histories are the same on every rank) and
    # hands them back whole, whatever the history length of the loading run.

    def get_extra_state(self) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save({role: h.state_dict() for role, h in self.fp8_state.histories()}, buffer)
        buffer.seek(0)
        return buffer

    def set_extra_state(self, state) -> None:
        """Restore what get_extra_state saved ({} or a "tensorwise" run's: fresh
        histories). The weight scales follow from the loaded weights: the
        converter's load_state_dict post-hook recomputes them. A load of full
        tensors through torch's set_model_state_dict carries no extra state:
        the histories stay as they are."""
        if _torch_compat.is_extra_state_placeholder(state):
            return
        if isinstance(state, (bytes, bytearray)):
            state = io.BytesIO(state)
        if isinstance(state, io.BytesIO):
            state.seek(0)
            state = torch.load(state, weights_only=True)
        if not isinstance(state, dict):
            raise TypeError(f"{type(self).__name__}: fp8 extra state must be what get_extra_state returned, "
                            f"got {type(state).__name__}")
        device = parallel_state.get_device_or_cpu()
        for role, history in self.fp8_state.histories():
            history.load_state_dict(state.get(role, {}), device)


_FP8_CLASSES: dict[type, type] = {}


def fp8_class(cls: type) -> type:
    """The fp8 subclass of a parallel linear class (made once per class)."""
    if issubclass(cls, Fp8Linear):
        return cls
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(f"Fp8{cls.__name__}", (Fp8Linear, cls), {"__module__": __name__})
    return _FP8_CLASSES[cls]


Fp8ColumnParallelLinear = fp8_class(ColumnParallelLinear)
Fp8RowParallelLinear = fp8_class(RowParallelLinear)


def to_fp8_linear(linear: nn.Module, recipe: Fp8Recipe, *, check_shape: bool = True) -> nn.Module:
    """Make one column- or row-parallel linear run fp8 GEMMs, in place (returns it).
    `check_shape=False` skips the CUDA GEMM shape rule (odd test shapes on the CPU).
    Unlike convert_to_fp8 it registers no post-step hook: the caller refreshes
    the scales after each optimizer step (`refresh_fp8_scales`)."""
    if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
        raise TypeError(f"to_fp8_linear: {type(linear).__name__} is not a column- or row-parallel linear")
    if isinstance(linear, Fp8Linear):
        return linear
    if check_shape:
        check_fp8_weight_shape(type(linear).__name__, *linear.local_weight_shape())
    linear.__class__ = fp8_class(type(linear))
    linear.fp8_state = Fp8LinearState(recipe)
    return linear


def linears_to_convert(model: nn.Module, config) -> list[tuple[str, nn.Module]]:
    """(name, linear) of every parallel linear `config` runs in fp8, each
    checked against the GEMM shape rule: raises before anything changes."""
    if getattr(config, "fp8", None) is None:
        return []
    found = []
    for layer_name, layer in model.named_modules():
        # Megatron numbers layers from 1; the first/last-layer rule counts from 0.
        if isinstance(layer, TransformerLayer) and layer_runs_fp8(config, layer.layer_number - 1):
            for name, m in layer.named_modules(prefix=layer_name):
                if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    if not isinstance(m, Fp8Linear):
                        check_fp8_weight_shape(type(m).__name__, *m.local_weight_shape())
                    found.append((name, m))
    return found


def _refresh_weight_scales_after_load(model: nn.Module, incompatible_keys) -> None:
    # torch's load_state_dict post-hook: loaded weights need their fp8 scales (a
    # collective: every rank loads). Runs for any load into the model, a DCP
    # checkpoint's (set_model_state_dict) included.
    refresh_fp8_weight_scales(model)


def convert_to_fp8(model: nn.Module, config=None) -> int:
    """The converter (see the module's docstring): `config` defaults to the
    model's own (`model.config`). Returns how many linears run fp8 now;
    converting twice changes nothing. Works on the meta device."""
    config = model.config if config is None else config
    linears = linears_to_convert(model, config)
    if linears:
        recipe = Fp8Recipe.from_config(config)
        if recipe.rowwise:
            out_dtype = (torch.bfloat16 if getattr(config, "bf16", False) else
                         torch.float16 if getattr(config, "fp16", False) else torch.float32)
            check_rowwise_support(parallel_state.get_device_or_cpu(), out_dtype, recipe.forward_dtype,
                                  recipe.backward_dtype)
        for _, linear in linears:
            to_fp8_linear(linear, recipe, check_shape=False)  # checked above
        if not getattr(model, "_fp8_hooks_registered", False):
            # The one post-step hook: the optimizer's step changes the weights, so their scales follow.
            register_post_step_hook(model, "fp8", lambda: refresh_fp8_scales(model))
            # So does a load (the histories load as the linears' extra state) or a broadcast.
            model.register_load_state_dict_post_hook(_refresh_weight_scales_after_load)
            register_weights_changed_hook(model, "fp8", lambda: refresh_fp8_weight_scales(model))
            model._fp8_hooks_registered = True
    if getattr(config, "fp8", None) is not None:
        for m in model.modules():
            if hasattr(m, "fp8_converted"):
                m.fp8_converted = True  # a model that refuses to run unconverted (GPTModel)
    return len(linears)


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
