"""ModelParallelConfig: Megatron-Core's parallelism and precision fields."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .utils import check_hierarchical_sizes, check_positive_int, reject_unsupported


def reject_unsupported_fields(config, unsupported: dict[str, object]) -> None:
    """Raise for a config field set away from the only value this library honours
    (utils.reject_unsupported, with the config's class and field values)."""
    reject_unsupported(type(config).__name__,
                        {name: (getattr(config, name), allowed) for name, allowed in unsupported.items()})


@dataclasses.dataclass
class ModelParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    # The group sizes of each level of hierarchical context parallelism: for cp_comm_type
    # "a2a+p2p", [a2a size, p2p size], whose product is context_parallel_size.
    hierarchical_context_parallel_sizes: Optional[list[int]] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None

    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32

    timers: Optional[Callable] = None
    finalize_model_grads_func: Optional[Callable] = None
    grad_scale_func: Optional[Callable] = None
    no_sync_func: Optional[Callable] = None
    grad_sync_func: Optional[Callable] = None
    param_sync_func: Optional[Callable] = None
    deterministic_mode: bool = False

    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = False
    tp_comm_overlap: bool = False
    use_te_rng_tracker: bool = False

    # The language model's loss by megatron_fsdp.fusions.fused_vocab_parallel_cross_entropy:
    # on CUDA one Triton kernel each way, reading the logits in their dtype (no fp32 copy);
    # the same loss, and the logits' gradient in their dtype.
    cross_entropy_loss_fusion: bool = False
    # Megatron's implementation choice: "native" (its own fused function; ours here) or "te"
    # (Transformer Engine's, which Megatron-LM rejects for stability and we do not have).
    cross_entropy_fusion_impl: str = "native"

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size"):
            check_positive_int(name, getattr(self, name))
        check_hierarchical_sizes(self.hierarchical_context_parallel_sizes, self.context_parallel_size)
        if self.expert_tensor_parallel_size is not None:
            check_positive_int("expert_tensor_parallel_size", self.expert_tensor_parallel_size)
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 cannot both be True")
        if not isinstance(self.params_dtype, torch.dtype) or not self.params_dtype.is_floating_point:
            raise ValueError(f"params_dtype must be a floating-point torch.dtype, got {self.params_dtype!r}")
        reject_unsupported_fields(self, {
            "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None,
            # Fusing wgrad into a main_grad buffer needs Megatron's own DDP buffers.
            "gradient_accumulation_fusion": False,
            "tp_comm_overlap": False,
            "use_te_rng_tracker": False,
            # Our kernels have one path; for CUDA determinism set
            # torch.use_deterministic_algorithms(True) yourself.
            "deterministic_mode": False,
        })
        if self.cross_entropy_fusion_impl not in ("native", "te"):
            raise ValueError(f"cross_entropy_fusion_impl={self.cross_entropy_fusion_impl!r}, allowed: 'native', 'te'")
        if self.cross_entropy_loss_fusion:
            reject_unsupported(type(self).__name__, {"cross_entropy_fusion_impl": (
                self.cross_entropy_fusion_impl, "native", "Transformer Engine's fused cross entropy is not available")})
