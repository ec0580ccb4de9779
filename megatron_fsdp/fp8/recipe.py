"""The fp8 recipe: what Megatron-Core's TransformerConfig fp8 fields (checked
by the config itself) mean for one linear, and which transformer layers run fp8.

Formats (`config.fp8`): "e4m3" uses float8_e4m3fn for every fp8 tensor;
"hybrid" uses e4m3 for weights and activations and float8_e5m2 (more range,
less precision) for the output gradients.

Recipes (`config.fp8_recipe`), for activations and output gradients:
"tensorwise" scales each tensor by its own amax just before the cast
(current scaling); "delayed" scales it from an amax history of the previous
steps (`fp8_amax_history_len` entries, reduced with `fp8_amax_compute_algo`),
as Transformer Engine's delayed scaling does. Weights always use the amax of
their current values: it is known exactly once per step (see refresh.py).
"rowwise" scales every operand of every GEMM (weights included) per row of
the reduction: one scale per token, per output feature, ... from the current
values (torchao's rowwise recipe: an outlier costs precision in its own row
only). It needs a torch._scaled_mm that takes row scales on the device
(`check_rowwise_support`), and does not combine with fp8 weight all-gather,
whose weights carry one scale.
"""

from __future__ import annotations

import dataclasses

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """What one fp8 linear needs to know from the config."""

    format: str = "hybrid"
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True

    @property
    def forward_dtype(self) -> torch.dtype:
        """The fp8 dtype of weights and activations."""
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """The fp8 dtype of output gradients."""
        return E5M2 if self.format == "hybrid" else E4M3

    @property
    def delayed(self) -> bool:
        return self.recipe == "delayed"

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @classmethod
    def from_config(cls, config) -> "Fp8Recipe":
        if config.fp8 is None:
            raise ValueError("Fp8Recipe.from_config: config.fp8 is None (fp8 is off)")
        return cls(format=config.fp8, recipe=config.fp8_recipe, margin=config.fp8_margin,
                   amax_history_len=config.fp8_amax_history_len,
                   amax_compute_algo=config.fp8_amax_compute_algo, wgrad=config.fp8_wgrad)


def is_first_last_bf16_layer(config, layer_no: int) -> bool:
    """True when the transformer layer with 0-based global index `layer_no`
    stays in high precision under `first_last_layers_bf16` (Megatron's rule)."""
    if not config.first_last_layers_bf16 or layer_no < 0:
        return False
    return (layer_no < config.num_layers_at_start_in_bf16
            or layer_no >= config.num_layers - config.num_layers_at_end_in_bf16)


def layer_runs_fp8(config, layer_no: int) -> bool:
    """Whether the linears of transformer layer `layer_no` (0-based) run fp8 GEMMs."""
    return getattr(config, "fp8", None) is not None and not is_first_last_bf16_layer(config, layer_no)
