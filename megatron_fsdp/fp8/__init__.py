"""fp8 training: fp8 GEMMs in the parallel linears and fp8 weight all-gather through FSDP2.

What runs in fp8 (TransformerConfig, Megatron-Core's fields):
  `fp8="e4m3"|"hybrid"` turns on fp8 GEMMs (forward, input gradient and,
  with `fp8_wgrad`, weight gradient) in every ColumnParallelLinear and
  RowParallelLinear of the transformer layers (QKV, attention output, MLP
  fc1/fc2), except the first/last `num_layers_at_{start,end}_in_bf16` layers
  under `first_last_layers_bf16`. Norms, embeddings, the output layer,
  softmax and the loss stay in high precision. `fp8_recipe`, `fp8_margin`,
  `fp8_amax_history_len`, `fp8_amax_compute_algo`: see recipe.py.
  `convert_to_fp8(model)` applies this, the one place fp8 enters a model
  (convert.py): the FSDP plan calls it; without the wrapper, call it yourself.

fp8 weight all-gather (`DistributedDataParallelConfig(fp8_param_gather=True)`),
the interface the FSDP wrapper uses, in order:
  1. `check_fp8_param_gather(config, ddp_config, reshard_after_forward)`:
     raises for combinations that cannot work (no fp8 in the config, an
     integer reshard_after_forward, fp8_param without fp8_param_gather, the
     rowwise recipe).
     Configuration only, no communication.
  2. `convert_to_fp8_weights(module) -> int`: before fully_shard, replaces
     the weight of every linear that runs fp8 by an `Fp8TrainingWeight`
     (FSDP2's all-gather extension; DTensor layout and Megatron's TP
     attributes kept); returns the number converted. Meta-device weights
     are fine: they are converted on meta.
  3. `refresh_fp8_scales(module)`: once the weights hold their values (after
     materialization + initialization of a meta-built model, or after
     fully_shard of an eager one) and before the first forward. Collective.
  Afterwards the converter's post-step hook calls `refresh_fp8_scales` after
  every MegatronOptimizer step; a loop with another optimizer calls it itself.

Checkpoints: master weights are saved as plain tensors. The delayed-scaling
histories are each converted linear's module state (`get_extra_state`), so
they travel in the model's state dict and its DCP checkpoints like any other
module state; the converter's load_state_dict post-hook recomputes the weight
scales from loaded weights (a collective, on every rank). Checkpoints written
before kept the histories in an "fp8" entry (common.pt's): the checkpoint
loader's migration step reads them into the model (load_fp8_state_dict).
The optimizer and the wrapper only run what the converter registered.
"""

from ..fp8_utils import check_fp8_param_gather
from .convert import (
    Fp8ColumnParallelLinear,
    Fp8Linear,
    Fp8RowParallelLinear,
    convert_to_fp8,
    convert_to_fp8_weights,
    linears_to_convert,
    to_fp8_linear,
)
from .linear import Fp8LinearState, check_fp8_weight_shape, fp8_linear, materialize_fp8_state
from .recipe import Fp8Recipe, is_first_last_bf16_layer, layer_runs_fp8
from .refresh import (fp8_state_dict, has_fp8_linears, load_fp8_state_dict, refresh_fp8_scales,
                      refresh_fp8_weight_scales)
from .weight import Fp8GatheredWeight, Fp8TrainingWeight, is_fp8_training_weight

__all__ = [
    "Fp8ColumnParallelLinear",
    "Fp8GatheredWeight",
    "Fp8Linear",
    "Fp8RowParallelLinear",
    "Fp8LinearState",
    "Fp8Recipe",
    "Fp8TrainingWeight",
    "check_fp8_param_gather",
    "check_fp8_weight_shape",
    "convert_to_fp8",
    "convert_to_fp8_weights",
    "fp8_linear",
    "materialize_fp8_state",
    "fp8_state_dict",
    "has_fp8_linears",
    "is_first_last_bf16_layer",
    "is_fp8_training_weight",
    "layer_runs_fp8",
    "linears_to_convert",
    "load_fp8_state_dict",
    "refresh_fp8_scales",
    "refresh_fp8_weight_scales",
    "to_fp8_linear",
]
