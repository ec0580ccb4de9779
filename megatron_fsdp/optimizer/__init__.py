from .clip_grads import clip_grad_by_total_norm_fp32, clip_grad_norm_, count_zeros_fp32, get_grad_norm_fp32
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "MegatronGradScaler",
    "MegatronOptimizer",
    "OptimizerConfig",
    "clip_grad_by_total_norm_fp32",
    "clip_grad_norm_",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "get_megatron_optimizer",
]
