"""TransformerConfig: Megatron-Core's field names and defaults, validated up front."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Optional

import torch.nn.functional as F

from ..model_parallel_config import ModelParallelConfig, reject_unsupported
from .utils import init_method_normal, scaled_init_method_normal

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_RECOMPUTE_GRANULARITIES = (None, "full", "selective")
_RECOMPUTE_METHODS = (None, "uniform", "block")
_RECOMPUTE_MODULES = ("core_attn",)
# Megatron's kernel-fusion switches. Results do not depend on them: they are
# accepted, and the unfused PyTorch path runs (one warning says so).
_FUSION_FLAGS = ("bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm",
                 "memory_efficient_layer_norm", "bias_dropout_fusion", "apply_rope_fusion")


@dataclasses.dataclass
class TransformerConfig(ModelParallelConfig):
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    softmax_scale: Optional[float] = None

    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable = F.gelu
    normalization: str = "LayerNorm"
    qk_layernorm: bool = False
    rotary_interleaved: bool = False
    window_size: Optional[tuple[int, int]] = None
    num_moe_experts: Optional[int] = None
    multi_latent_attention: bool = False
    calculate_per_token_loss: bool = False
    test_mode: bool = False

    init_method: Optional[Callable] = None
    output_layer_init_method: Optional[Callable] = None
    init_method_std: float = 0.02
    init_model_with_meta_device: bool = False

    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True

    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False
    bias_dropout_fusion: bool = False
    apply_rope_fusion: bool = False

    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[list[str]] = None
    distribute_saved_activations: Optional[bool] = None

    fp8: Optional[str] = None

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        tp = self.tensor_model_parallel_size
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.num_query_groups % tp != 0:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) unless kv_channels is given"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(
                f"ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by "
                f"tensor_model_parallel_size ({tp})"
            )
        if self.normalization not in _NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {_NORMALIZATIONS}, got {self.normalization!r}")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        self._check_recompute()
        reject_unsupported(self, {
            "num_moe_experts": None,
            "multi_latent_attention": False,
            "window_size": None,
            "rotary_interleaved": False,
            "apply_residual_connection_post_layernorm": False,
            "fp32_residual_connection": False,
            "apply_query_key_layer_scaling": False,
            "attention_softmax_in_fp32": True,
            "calculate_per_token_loss": False,
            "fp8": None,
        })
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)
        fused = [name for name in _FUSION_FLAGS if getattr(self, name)]
        if fused:
            warnings.warn(
                f"TransformerConfig: {', '.join(fused)} accepted; megatron_fsdp runs the "
                "unfused PyTorch path (same results)", stacklevel=3)

    def _check_recompute(self):
        if self.recompute_granularity not in _RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute_granularity must be one of {_RECOMPUTE_GRANULARITIES}, "
                f"got {self.recompute_granularity!r}"
            )
        if self.recompute_method not in _RECOMPUTE_METHODS:
            raise ValueError(
                f"recompute_method must be one of {_RECOMPUTE_METHODS}, got {self.recompute_method!r}"
            )
        if self.distribute_saved_activations:
            raise NotImplementedError("distribute_saved_activations=True is not supported by megatron_fsdp")
        if self.recompute_granularity == "full":
            if self.recompute_method is None:
                raise ValueError(
                    "recompute_granularity='full' needs recompute_method 'uniform' or 'block'"
                )
            n = self.recompute_num_layers
            if not isinstance(n, int) or not 1 <= n <= self.num_layers:
                raise ValueError(
                    f"recompute_num_layers must be an integer in [1, num_layers={self.num_layers}] "
                    f"with recompute_granularity='full', got {n!r}"
                )
        elif self.recompute_granularity == "selective":
            if self.recompute_method is not None or self.recompute_num_layers is not None:
                raise ValueError(
                    "recompute_method and recompute_num_layers apply to recompute_granularity='full' "
                    "only; leave them None with 'selective'"
                )
            modules = self.recompute_modules if self.recompute_modules is not None else ["core_attn"]
            bad = [m for m in modules if m not in _RECOMPUTE_MODULES]
            if bad:
                raise ValueError(f"recompute_modules {bad} are not supported (allowed: {_RECOMPUTE_MODULES})")
            self.recompute_modules = list(modules)
        elif self.recompute_method is not None or self.recompute_num_layers is not None:
            raise ValueError(
                "recompute_method / recompute_num_layers are set but recompute_granularity is None"
            )

    @property
    def softmax_scale_value(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.kv_channels)
