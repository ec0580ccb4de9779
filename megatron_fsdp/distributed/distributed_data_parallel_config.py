"""DistributedDataParallelConfig with Megatron-Core's fields and defaults.

Fields this library honours are documented on the class; every other field
raises NotImplementedError when set away from its default, so no option is
silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..fp8_utils import check_fp8_reshard
from ..utils import check_positive_int, reject_unsupported


@dataclasses.dataclass
class DistributedDataParallelConfig:
    """Honoured by TorchFullyShardedDataParallel:

    - grad_reduce_in_fp32: reduce-scatter gradients in fp32 under bf16/fp16 training.
    - overlap_grad_reduce / overlap_param_gather: FSDP2 always overlaps its
      reduce-scatters and all-gathers with compute, so both values hold.
    - use_distributed_optimizer: FSDP always shards optimizer state (True holds;
      False is the Megatron default and changes nothing under FSDP).
    - num_distributed_optimizer_instances: > 1 selects HSDP, replicating across
      instances and sharding within one (must match parallel_state).
    - check_for_nan_in_grad: finish_grad_sync() raises if a gradient is not finite.
    - average_in_collective: gradients are averaged over data-parallel ranks
      either way; the flag only selects how Megatron computes the same mean.
    - fp8_param_gather: the tensor-parallel linear weights are all-gathered in
      fp8 (half the bytes of bf16) through FSDP2's tensor-subclass extension
      (megatron_fsdp.fp8); needs `config.fp8` and a True/False
      reshard_after_forward, checked when the model is wrapped.
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: Optional[int] = None
    pad_buckets_for_high_nccl_busbw: bool = False
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_custom_fsdp: bool = False
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: Optional[int] = None
    preserve_fp32_weights: bool = True
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    delay_wgrad_compute: bool = False

    # Why each unsupported field is unsupported, for the error message.
    _UNSUPPORTED = {
        "align_param_gather": "it aligns pipeline-parallel param gathers; there is no pipeline parallelism",
        "check_for_large_grads": "not implemented",
        "bucket_size": "FSDP2 communicates per wrapped module: choose the units with sub_modules_to_wrap, "
                       "or one unit with disable_bucketing=True",
        "pad_buckets_for_high_nccl_busbw": "FSDP2 has no Megatron buckets",
        "reuse_grad_buf_for_mxfp8_param_ag": "mxfp8 is not supported",
        "use_custom_fsdp": "this is the torch FSDP2 path, not Megatron-FSDP",
        "use_megatron_fsdp": "this is the torch FSDP2 path, not Megatron-FSDP",
        "data_parallel_sharding_strategy": "a Megatron-FSDP option; use reshard_after_forward "
                                           "(True = ZeRO-3, False = ZeRO-2)",
        "gradient_reduce_div_fusion": "a Megatron-FSDP option",
        "suggested_communication_unit_size": "a Megatron-FSDP option; use sub_modules_to_wrap",
        "preserve_fp32_weights": "master weights are always fp32 under mixed precision",
        "keep_fp8_transpose_cache": "a Transformer Engine fp8 option",
        "nccl_ub": "NCCL user buffers are not supported",
        "fsdp_double_buffer": "a Megatron-FSDP option",
        "outer_dp_sharding_strategy": "a Megatron-FSDP option; HSDP replicates across "
                                      "num_distributed_optimizer_instances (HFSDP, the optimizer sharded "
                                      "across replicas too, is megatron_fsdp.fully_shard's)",
        "disable_symmetric_registration": "a Megatron-FSDP option",
        "delay_wgrad_compute": "not implemented",
    }

    def __post_init__(self):
        check_positive_int("num_distributed_optimizer_instances", self.num_distributed_optimizer_instances)
        if not isinstance(self.fp8_param_gather, bool):
            raise ValueError(f"fp8_param_gather must be True or False, got {self.fp8_param_gather!r}")
        defaults = {f.name: f.default for f in dataclasses.fields(DistributedDataParallelConfig)}
        reject_unsupported(type(self).__name__, {name: (getattr(self, name), defaults[name], why)
                                                 for name, why in self._UNSUPPORTED.items()})


@dataclasses.dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """reshard_after_forward: True frees gathered parameters after forward and
    gathers them again in backward (ZeRO-3); False keeps them until backward
    (ZeRO-2); an int n keeps them sharded over groups of n ranks in between
    (n must divide the data-parallel shard size).

    accumulate_unsharded_grads_in_no_sync: False (the default, Megatron-Core's
    behaviour) makes no_sync() a no-op: every microbatch's backward
    reduce-scatters, and gradients accumulate in the sharded `.grad` (1/DP of
    the model per rank). True makes backward inside no_sync() skip the
    reduce-scatter and keep one full unsharded gradient per parameter (of this
    rank's TP shard), in the reduce dtype, between microbatches: 4 bytes per
    parameter in fp32, 280 GB for a 70B model at TP1, on every rank. It trades
    that memory for one reduce-scatter per step instead of one per microbatch,
    so it suits communication-bound runs with memory to spare. Under bf16
    without grad_reduce_in_fp32 the unsharded accumulation is in bf16, while
    the default accumulates each microbatch's reduced gradient in fp32 shards.

    fsdp_copy_kernels: True makes megatron_fsdp's C++/CUDA kernels serve FSDP2's
    copy ops (all-gather copy-in with the mixed-precision cast fused, copy-out,
    reduce-scatter copy-in; bitwise torch's results). The op registry is
    process-wide, so once one wrapped model asks, every `fully_shard` module of
    the process runs them until `kernels.fsdp_copy_ops.disable_fsdp_copy_kernels()`.
    False (the default) leaves stock FSDP2. A torch whose copy-op schemas
    differ, or a missing extension, keeps torch's path with one warning.

    torch_compile: True compiles each unit that is a TransformerLayer with
    torch.compile before it is sharded (torchtitan's per-block compile;
    `nn.Module.compile`, so the layer keeps its type and its parameter
    names, and checkpoints are the same). The first steps pay the
    compilation; FSDP2's all-gathers and reduce-scatters stay outside the
    compiled graphs. False (the default) runs the layers eagerly.

    cpu_offload: True keeps the sharded parameters, gradients and optimizer
    state in CPU memory (pinned under CUDA; FSDP2's CPUOffloadPolicy): each
    unit's parameters are copied to the device for its all-gather, gradients
    come back after the reduce-scatter, and the optimizer steps on the CPU
    (OptimizerConfig(optimizer_cpu_offload=True); --optimizer-cpu-offload).
    Device memory then holds only the gathered units and activations."""

    reshard_after_forward: bool | int = True
    accumulate_unsharded_grads_in_no_sync: bool = False
    fsdp_copy_kernels: bool = False
    torch_compile: bool = False
    cpu_offload: bool = False

    def __post_init__(self):
        super().__post_init__()
        value = self.reshard_after_forward
        if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 2):
            raise ValueError(
                f"reshard_after_forward must be True, False or an int >= 2, got {value!r}"
            )
        if self.fp8_param_gather:
            check_fp8_reshard(value)
        for name in ("accumulate_unsharded_grads_in_no_sync", "fsdp_copy_kernels", "torch_compile", "cpu_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.cpu_offload and self.fp8_param_gather:
            raise ValueError("cpu_offload=True with fp8_param_gather=True is not supported: the fp8 weights are "
                             "cast on the device for their all-gather")
