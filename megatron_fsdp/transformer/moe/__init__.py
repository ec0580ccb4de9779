"""Mixture-of-experts layers, at Megatron-Core's module paths and with its class names."""

from .experts import GroupedMLP, SequentialMLP
from .moe_layer import MoELayer, MoESubmodules
from .moe_logging import MoEMetricsTracker, get_moe_metrics_tracker, reduce_moe_metrics
from .moe_utils import MoEAuxLossAutoScaler
from .router import TopKRouter
from .shared_experts import SharedExpertMLP
from .token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

__all__ = [
    "GroupedMLP",
    "MoEAllGatherTokenDispatcher",
    "MoEAlltoAllTokenDispatcher",
    "MoEAuxLossAutoScaler",
    "MoELayer",
    "MoEMetricsTracker",
    "MoESubmodules",
    "SequentialMLP",
    "SharedExpertMLP",
    "TopKRouter",
    "get_moe_metrics_tracker",
    "reduce_moe_metrics",
]
