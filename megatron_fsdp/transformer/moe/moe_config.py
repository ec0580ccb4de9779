"""TransformerConfig's mixture-of-experts fields: Megatron-Core's rules, and what we do not build.

Called from TransformerConfig.__post_init__, so a bad combination raises where the config is
made, before any work or communication; the flags' validation (training/arguments.py) says the
same in the flags' words.
"""

from __future__ import annotations

from ...utils import check_positive_int, reject_unsupported

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
TOKEN_DISPATCHER_TYPES = ("allgather", "alltoall")
TOKEN_DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = (None, "fp32", "fp64")


def check_moe_config(config) -> None:
    """Megatron-Core's checks of the MoE fields (and moe_ffn_hidden_size's default)."""
    if config.num_moe_experts is None:
        return
    check_positive_int("num_moe_experts", config.num_moe_experts)
    experts, topk = config.num_moe_experts, config.moe_router_topk
    check_positive_int("moe_router_topk", topk)
    if topk > experts:
        raise ValueError(f"moe_router_topk ({topk}) must be at most num_moe_experts ({experts})")
    if config.moe_ffn_hidden_size is None:
        config.moe_ffn_hidden_size = config.ffn_hidden_size
    check_positive_int("moe_ffn_hidden_size", config.moe_ffn_hidden_size)
    _check_parallel(config)
    _check_layer_freq(config)
    _check_router(config)
    _check_dispatch(config)
    _check_shared_expert(config)
    reject_unsupported(type(config).__name__, {name: (getattr(config, name), allowed, why) for name, allowed, why in (
        ("add_bias_linear", False, "mixture-of-experts layers have no biases here (set add_bias_linear=False)"),
        ("fp8", None, "fp8 expert GEMMs are not supported yet: train mixture-of-experts models in bf16"),
        ("moe_router_num_groups", None, "group-limited routing is not supported"),
        ("moe_router_group_topk", None, "group-limited routing is not supported"),
        ("moe_input_jitter_eps", None, "input jitter is not supported"),
        ("moe_shared_expert_overlap", False, "the shared expert runs before the router"),
        ("moe_permute_fusion", False, "Transformer Engine's fused permutation is not used"),
        ("moe_router_fusion", False, "Transformer Engine's fused router is not used"),
        ("moe_layer_recompute", False, "use recompute_granularity instead"),
        ("moe_per_layer_logging", False, "the auxiliary losses are logged as their mean over the layers"),
        ("moe_apply_probs_on_input", False, "the routing probabilities weigh the experts' outputs"),
    )})


def _check_parallel(config) -> None:
    ep = config.expert_model_parallel_size
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if config.num_moe_experts % ep:
        raise ValueError(f"num_moe_experts ({config.num_moe_experts}) must be divisible by "
                         f"expert_model_parallel_size ({ep})")
    if config.moe_ffn_hidden_size % etp:
        raise ValueError(f"moe_ffn_hidden_size ({config.moe_ffn_hidden_size}) must be divisible by "
                         f"expert_tensor_parallel_size ({etp})")
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        # NOTE: Megatron-LM's rule: each TP rank routes its own part of the tokens.
        raise ValueError("mixture-of-experts layers with tensor_model_parallel_size > 1 need sequence_parallel=True")


def _check_layer_freq(config) -> None:
    freq = config.moe_layer_freq
    if isinstance(freq, (list, tuple)):
        if len(freq) != config.num_layers or any(f not in (0, 1) for f in freq):
            raise ValueError(f"moe_layer_freq as a pattern needs one 0 (dense) or 1 (MoE) per layer "
                             f"({config.num_layers}), got {list(freq)}")
    elif isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise ValueError(f"moe_layer_freq must be a positive int or a list of 0/1 per layer, got {freq!r}")


def _check_router(config) -> None:
    _one_of("moe_router_load_balancing_type", config.moe_router_load_balancing_type, LOAD_BALANCING_TYPES)
    _one_of("moe_router_score_function", config.moe_router_score_function, SCORE_FUNCTIONS)
    _one_of("moe_router_dtype", config.moe_router_dtype, ROUTER_DTYPES)
    if (config.moe_router_topk == 1 and config.moe_router_score_function == "softmax"
            and not config.moe_router_pre_softmax):
        # Megatron's: a softmax over one selected score has a zero gradient.
        raise ValueError("moe_router_topk=1 with softmax scores needs moe_router_pre_softmax=True")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        raise ValueError("moe_router_enable_expert_bias (aux-loss-free balancing) needs "
                         "moe_router_score_function='sigmoid'")
    for name in ("moe_aux_loss_coeff", "moe_router_bias_update_rate"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    z = config.moe_z_loss_coeff
    if z is not None and (isinstance(z, bool) or not isinstance(z, (int, float)) or z < 0):
        raise ValueError(f"moe_z_loss_coeff must be None or a number >= 0, got {z!r}")
    scale = config.moe_router_topk_scaling_factor
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
        raise ValueError(f"moe_router_topk_scaling_factor must be None or a positive number, got {scale!r}")


def _check_dispatch(config) -> None:
    _one_of("moe_token_dispatcher_type", config.moe_token_dispatcher_type, TOKEN_DISPATCHER_TYPES)
    _one_of("moe_token_drop_policy", config.moe_token_drop_policy, TOKEN_DROP_POLICIES)
    factor = config.moe_expert_capacity_factor
    if factor is not None and factor < 0:
        config.moe_expert_capacity_factor = factor = None  # Megatron's: a negative factor is dropless
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor == 0):
        raise ValueError(f"moe_expert_capacity_factor must be None (dropless) or a positive number, got {factor!r}")
    if config.moe_pad_expert_input_to_capacity and factor is None:
        raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
    most = config.num_moe_experts / config.moe_router_topk
    if config.moe_pad_expert_input_to_capacity and factor > most:
        # NOTE: a capacity above a rank's token count cannot be filled with distinct tokens.
        raise ValueError(f"moe_pad_expert_input_to_capacity with moe_expert_capacity_factor={factor}: the capacity "
                         f"would exceed a rank's tokens; the factor must be at most num_moe_experts / "
                         f"moe_router_topk = {most:g}")


def _check_shared_expert(config) -> None:
    size = config.moe_shared_expert_intermediate_size
    if size is None:
        if config.moe_shared_expert_gate:
            raise ValueError("moe_shared_expert_gate needs moe_shared_expert_intermediate_size (a shared expert)")
        return
    check_positive_int("moe_shared_expert_intermediate_size", size)
    if size % config.tensor_model_parallel_size:
        raise ValueError(f"moe_shared_expert_intermediate_size ({size}) must be divisible by "
                         f"tensor_model_parallel_size ({config.tensor_model_parallel_size})")


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}={value!r} is not supported (one of {shown})")


def is_moe_layer(config, layer_number: int) -> bool:
    """Layer `layer_number` (from 1) has a mixture of experts (Megatron's moe_layer_freq)."""
    if config.num_moe_experts is None:
        return False
    freq = config.moe_layer_freq
    if isinstance(freq, (list, tuple)):
        return bool(freq[layer_number - 1])
    return (layer_number - 1) % freq == 0
