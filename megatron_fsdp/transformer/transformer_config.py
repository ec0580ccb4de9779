"""TransformerConfig: Megatron-Core's field names and defaults, validated up front."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Union

import torch.nn.functional as F

from ..model_parallel_config import ModelParallelConfig
from ..utils import check_positive_int, reject_unsupported
from .enums import CP_COMM_TYPES
from .moe.moe_config import check_moe_config
from .utils import init_method_normal, scaled_init_method_normal

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_RECOMPUTE_GRANULARITIES = (None, "full", "selective")
_RECOMPUTE_METHODS = (None, "uniform", "block")
_RECOMPUTE_MODULES = ("core_attn",)


FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "rowwise")
# Megatron-Core accepts these; they need Transformer Engine kernels we do not have.
_TE_ONLY_FP8_RECIPES = ("mxfp8", "blockwise", "custom")
FP8_AMAX_COMPUTE_ALGOS = ("most_recent", "max")


def _check_int(name: str, value, minimum=None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{name} must be an integer{bound}, got {value!r}")


def check_fp8_config(config) -> None:
    """TransformerConfig's fp8 fields (called from its __post_init__; fp8/ gives them effect)."""
    where = type(config).__name__
    if config.fp8 is not None and config.fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8 must be one of {FP8_FORMATS} or None, got {config.fp8!r}")
    # As in Megatron, the recipe matters (and is checked) only with fp8 on.
    if config.fp8 is not None and config.fp8_recipe in _TE_ONLY_FP8_RECIPES:
        raise NotImplementedError(
            f"{where}: fp8_recipe={config.fp8_recipe!r} is not supported by megatron_fsdp "
            f"(supported: {FP8_RECIPES}); it needs Transformer Engine's kernels")
    if config.fp8 is not None and config.fp8_recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe must be one of {FP8_RECIPES}, got {config.fp8_recipe!r}")
    _check_int("fp8_margin", config.fp8_margin)
    _check_int("fp8_amax_history_len", config.fp8_amax_history_len, minimum=1)
    if config.fp8_amax_compute_algo not in FP8_AMAX_COMPUTE_ALGOS:
        raise ValueError(f"fp8_amax_compute_algo must be one of {FP8_AMAX_COMPUTE_ALGOS}, "
                         f"got {config.fp8_amax_compute_algo!r}")
    for name in ("fp8_wgrad", "fp8_param", "first_last_layers_bf16"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}")
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        value = getattr(config, name)
        _check_int(name, value, minimum=0)
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


@dataclasses.dataclass
class TransformerConfig(ModelParallelConfig):
    """Megatron-Core's TransformerConfig fields and defaults; a field set to a
    value megatron_fsdp cannot honour raises here, before anything is built.

    Megatron's fusion flags select kernels whose numerics differ from the
    unfused path in places; each flag gives Megatron's numerics for the path
    it selects:

    - bias_activation_fusion: Megatron's fused bias + activation. With
      activation_func=F.gelu it uses the tanh approximation of GELU (bias-GELU,
      and GeGLU with gated_linear_unit) where the unfused path uses exact GELU;
      with F.silu and gated_linear_unit it is SwiGLU. All of it runs in fp32
      and rounds once (Megatron's torch.compile'd kernel); backward uses
      Megatron's closed-form derivatives. Other activations, SiLU without
      gating, and GELU without gating or bias raise ValueError, as in Megatron.
    - bias_dropout_fusion: Megatron's compiled residual + dropout(x + bias):
      fp32 arithmetic rounded once (the unfused path rounds after each op;
      fp32 results are the same).
    - apply_rope_fusion: Transformer Engine's fused RoPE numerics: rotation in
      fp32 with fp32 cos/sin, rounded once. Unfused (Megatron's
      `_apply_rotary_pos_emb_bshd`): cos/sin rounded to the activation dtype
      and the rotation in that dtype. Angles are fp32 in both.
    - masked_softmax_fusion: chooses, in Megatron's local attention, between
      Apex's fused scale-mask-softmax and torch softmax, both an fp32 softmax
      of the same scores with masked scores at -10000. Attention here is one
      implementation (SDPA, with Megatron's fully-masked-row behaviour, see
      DotProductAttention); the flag changes nothing. (Megatron's fused causal
      kernel ignores an explicit attention_mask; here the mask always applies.)
    - persist_layer_norm, memory_efficient_layer_norm: choose Apex LayerNorm
      kernels in Megatron (fp32 statistics, output in the input dtype, as
      F.layer_norm computes); memory_efficient only changes what backward
      keeps. No change to results here.
    - gradient_accumulation_fusion (ModelParallelConfig): accumulates weight
      gradients into Megatron's fp32 main_grad buffers, which FSDP2 does not
      have: True raises.
    """

    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    softmax_scale: Optional[float] = None
    # Megatron's: how context-parallel attention communicates ("p2p", "all_gather", "a2a"; one
    # value, or one per layer). None is "p2p" (Megatron's default with Transformer Engine).
    cp_comm_type: Optional[Union[str, list]] = None

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
    # Megatron's: the sequence-parallel split is a view of the whole embedding
    # output; a copy lets the whole one be freed (and FSDP2 warns about views).
    clone_scatter_output_in_embedding: bool = True

    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[list[str]] = None
    distribute_saved_activations: Optional[bool] = None

    # Mixture of experts (transformer/moe/): Megatron-Core's fields and defaults; checked in
    # moe/moe_config.py. None experts: dense MLPs only.
    num_moe_experts: Optional[int] = None
    moe_layer_freq: Union[int, list] = 1  # every N-th layer MoE, or a 0/1 pattern per layer
    moe_ffn_hidden_size: Optional[int] = None  # None: ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_load_balancing_type: str = "aux_loss"  # "aux_loss", "seq_aux_loss", "global_aux_loss", "none"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_router_score_function: str = "softmax"  # or "sigmoid"
    moe_router_pre_softmax: bool = False  # softmax over all experts before the top-k
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_dtype: Optional[str] = None  # "fp32" or "fp64": the router's logits and scores
    moe_router_enable_expert_bias: bool = False  # aux-loss-free balancing (sigmoid scores)
    moe_router_bias_update_rate: float = 1e-3
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dispatcher_type: str = "allgather"  # or "alltoall"
    moe_grouped_gemm: bool = False  # torch._grouped_mm where the device has it (else one GEMM per expert)
    moe_expert_capacity_factor: Optional[float] = None  # None: dropless
    moe_token_drop_policy: str = "probs"  # or "position"
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert's output
    moe_shared_expert_overlap: bool = False
    moe_permute_fusion: bool = False
    moe_router_fusion: bool = False
    moe_layer_recompute: bool = False
    moe_per_layer_logging: bool = False
    moe_apply_probs_on_input: bool = False

    # fp8 (megatron_fsdp.fp8): Megatron-Core's fields and defaults. Unlike
    # Megatron-Core, first_last_layers_bf16 also works with the delayed recipe.
    fp8: Optional[str] = None
    fp8_recipe: Optional[str] = "delayed"
    fp8_param: bool = False
    fp8_quantizer_factory: Optional[str] = None
    fp8_margin: int = 0
    fp8_interval: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    fp8_output_proj: bool = False
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    tp_only_amax_red: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    activation_func_fp8_input_store: bool = False

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            check_positive_int(name, getattr(self, name))
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
        if self.kv_channels < 1:
            raise ValueError(f"kv_channels must be >= 1, got {self.kv_channels}")
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
        self._check_context_parallel()
        check_moe_config(self)
        reject_unsupported(type(self).__name__, {name: (getattr(self, name), allowed) for name, allowed in (
            ("multi_latent_attention", False),
            ("window_size", None),
            ("rotary_interleaved", False),
            ("apply_residual_connection_post_layernorm", False),
            ("fp32_residual_connection", False),
            ("apply_query_key_layer_scaling", False),
            ("attention_softmax_in_fp32", True),
            ("calculate_per_token_loss", False),
        )})
        check_fp8_config(self)
        self._check_bias_activation_fusion()
        if self.init_method is None:
            self.init_method = init_method_normal(self.init_method_std)
        if self.output_layer_init_method is None:
            self.output_layer_init_method = scaled_init_method_normal(self.init_method_std, self.num_layers)

    def _check_bias_activation_fusion(self):
        if not self.bias_activation_fusion:
            return
        name = getattr(self.activation_func, "__name__", repr(self.activation_func))
        if self.activation_func is F.gelu:
            if not self.gated_linear_unit and not self.add_bias_linear:
                raise ValueError("bias_activation_fusion=True with GELU and gated_linear_unit=False needs "
                                 "add_bias_linear=True (Megatron's fused bias-GELU has a bias)")
        elif self.activation_func is F.silu:
            if not self.gated_linear_unit:
                raise ValueError("bias_activation_fusion=True with activation_func=silu needs "
                                 "gated_linear_unit=True (SwiGLU); Megatron fuses no plain SiLU")
        else:
            raise ValueError(f"bias_activation_fusion=True needs activation_func F.gelu (GELU/GeGLU) or F.silu "
                             f"(SwiGLU), got {name}")

    def _check_context_parallel(self):
        """cp_comm_type's values (and count, one per layer), and what each needs of the heads."""
        kinds = self.cp_comm_type if isinstance(self.cp_comm_type, (list, tuple)) else [self.cp_comm_type]
        if isinstance(self.cp_comm_type, (list, tuple)) and len(kinds) != self.num_layers:
            raise ValueError(f"cp_comm_type has {len(kinds)} values: one, or one per layer ({self.num_layers})")
        for kind in kinds:
            if kind is not None and kind not in CP_COMM_TYPES:
                raise ValueError(f"cp_comm_type {kind!r} is not one of {', '.join(CP_COMM_TYPES)}")
        cp, tp = self.context_parallel_size, self.tensor_model_parallel_size
        heads, groups = self.num_attention_heads // tp, self.num_query_groups // tp
        if cp > 1 and "a2a" in kinds and (heads % cp or groups % cp):
            raise ValueError(f"cp_comm_type 'a2a' needs the attention heads ({heads}) and query groups "
                             f"({groups}) of a tensor-parallel rank divisible by context_parallel_size ({cp})")
        if cp > 1 and "a2a+p2p" in kinds:
            sizes = self.hierarchical_context_parallel_sizes
            if sizes is None or len(sizes) != 2:
                raise ValueError(f"cp_comm_type 'a2a+p2p' needs hierarchical_context_parallel_sizes = [a2a size, "
                                 f"p2p size] (product {cp}), got {sizes!r}")
            if heads % sizes[0] or groups % sizes[0]:
                raise ValueError(f"cp_comm_type 'a2a+p2p' needs the attention heads ({heads}) and query groups "
                                 f"({groups}) of a tensor-parallel rank divisible by the a2a size ({sizes[0]})")

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
