"""The fp8 recipe: Megatron-Core's TransformerConfig fp8 fields, checked, and
which transformer layers run fp8.

Formats (`config.fp8`): "e4m3" uses float8_e4m3fn for every fp8 tensor;
"hybrid" uses e4m3 for weights and activations and float8_e5m2 (more range,
less precision) for the output gradients.

Recipes (`config.fp8_recipe`), for activations and output gradients:
"tensorwise" scales each tensor by its own amax just before the cast
(current scaling); "delayed" scales it from an amax history of the previous
steps (`fp8_amax_history_len` entries, reduced with `fp8_amax_compute_algo`),
as Transformer Engine's delayed scaling does. Weights always use the amax of
their current values: it is known exactly once per step (see refresh.py).
"""

from __future__ import annotations

import dataclasses

import torch

from ..utils import reject_unsupported

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "delayed")
# Megatron-Core accepts these; they need Transformer Engine kernels we do not have.
_TE_ONLY_RECIPES = ("mxfp8", "blockwise", "custom")
AMAX_COMPUTE_ALGOS = ("most_recent", "max")

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


def _int(name: str, value, minimum=None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name} must be an integer{bound}, got {value!r}")


def check_fp8_config(config) -> None:
    """Validate TransformerConfig's fp8 fields (called from its __post_init__)."""
    where = type(config).__name__
    if config.fp8 is not None and config.fp8 not in FORMATS:
        raise ValueError(f"fp8 (--fp8-format) must be one of {FORMATS} or None, got {config.fp8!r}")
    # As in Megatron, the recipe matters (and is checked) only with fp8 on.
    if config.fp8 is not None and config.fp8_recipe in _TE_ONLY_RECIPES:
        raise NotImplementedError(
            f"{where}: fp8_recipe={config.fp8_recipe!r} is not supported by megatron_fsdp "
            f"(supported: {RECIPES}); it needs Transformer Engine's kernels")
    if config.fp8 is not None and config.fp8_recipe not in RECIPES:
        raise ValueError(f"fp8_recipe must be one of {RECIPES}, got {config.fp8_recipe!r}")
    _int("fp8_margin", config.fp8_margin)
    _int("fp8_amax_history_len", config.fp8_amax_history_len, minimum=1)
    if config.fp8_amax_compute_algo not in AMAX_COMPUTE_ALGOS:
        raise ValueError(f"fp8_amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, "
                         f"got {config.fp8_amax_compute_algo!r}")
    for name in ("fp8_wgrad", "fp8_param", "first_last_layers_bf16"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}")
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        value = getattr(config, name)
        _int(name, value, minimum=0)
        if config.first_last_layers_bf16 and value > config.num_layers:
            raise ValueError(f"{name} ({value}) must be between 0 and num_layers ({config.num_layers})")
    if config.fp8_param and config.fp8 is None:
        raise ValueError("fp8_param must be used together with fp8 mode (set fp8 to 'e4m3' or 'hybrid')")
    reject_unsupported(where, {
        "fp8_interval": (config.fp8_interval, 1, "deprecated in Megatron-Core; scales are updated every step"),
        "fp8_quantizer_factory": (config.fp8_quantizer_factory, None, "custom recipes need Transformer Engine"),
        "fp8_output_proj": (config.fp8_output_proj, False, "the output layer stays in high precision"),
        "fp8_dot_product_attention": (config.fp8_dot_product_attention, False,
                                      "attention runs in high precision; fp8 covers the linear layers"),
        "fp8_multi_head_attention": (config.fp8_multi_head_attention, False,
                                     "attention runs in high precision; fp8 covers the linear layers"),
        "activation_func_fp8_input_store": (config.activation_func_fp8_input_store, False, "not implemented"),
        "tp_only_amax_red": (config.tp_only_amax_red, False,
                             "fp8 weights are sharded over data- and tensor-parallel ranks, so their amax is "
                             "reduced over both"),
    })
