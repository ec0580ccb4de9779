"""The one place the command line becomes configs.

`build_configs(args)` runs right after parsing (arguments.py calls it, on
every rank, before any process group exists) and returns every config the
run uses: the model's TransformerConfig, the FSDP wrapper's config, the
optimizer's and the learning-rate schedule's. Each rule about a value lives
in its dataclass (or in OptimizerParamScheduler for the schedule); a
dataclass's error comes back as one flag error in the flags' own words
(`in_flag_words`). arguments.py keeps only the rules about flags themselves.
"""

from __future__ import annotations

import dataclasses
import re

import torch.nn.functional as F

from ..distributed import TorchFullyShardedDataParallelConfig
from ..fp8_utils import check_fp8_param_gather
from ..optimizer import OptimizerConfig
from ..transformer import TransformerConfig


@dataclasses.dataclass(frozen=True)
class TrainingConfigs:
    """Everything the flags configure, built once (`args.configs`)."""

    model: TransformerConfig  # what core_transformer_config_from_args builds: Megatron's model provider does too
    ddp: TorchFullyShardedDataParallelConfig  # sharded with --use-torch-fsdp2, else replicated (shard size 1)
    optimizer: OptimizerConfig
    scheduler: dict  # OptimizerParamScheduler's keyword arguments, less the optimizer (counted in samples)


def core_transformer_config_from_args(args, config_class=None):
    """The TransformerConfig the flags describe (Megatron-LM's helper of the same name).
    The fp8 fields are passed only with --fp8-format."""
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size, cp_comm_type=args.cp_comm_type,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, bf16=args.bf16, fp16=args.fp16,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        # As Megatron-LM: no bias, no bias+GELU fusion; RoPE fusion only with RoPE.
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else
        (args.bias_gelu_fusion and not args.disable_bias_linear),
        masked_softmax_fusion=args.masked_softmax_fusion, bias_dropout_fusion=args.bias_dropout_fusion,
        apply_rope_fusion=args.apply_rope_fusion and args.position_embedding_type == "rope",
        persist_layer_norm=not args.no_persist_layer_norm,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        **_moe_fields(args),
    )
    if args.fp8 is not None:
        fields.update(fp8=args.fp8, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                      fp8_amax_history_len=args.fp8_amax_history_len,
                      fp8_amax_compute_algo=args.fp8_amax_compute_algo, fp8_wgrad=args.fp8_wgrad,
                      first_last_layers_bf16=args.first_last_layers_bf16,
                      num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
                      num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16, fp8_param=args.fp8_param_gather)
    return (config_class or TransformerConfig)(**fields)


def _moe_fields(args) -> dict:
    """TransformerConfig's MoE fields: each --moe-* flag sets the field of the same name."""
    if args.num_experts is None:
        return {}
    names = [f.name for f in dataclasses.fields(TransformerConfig) if f.name.startswith("moe_")]
    return {"num_moe_experts": args.num_experts, **{n: getattr(args, n) for n in names if hasattr(args, n)}}


def ddp_config_from_args(args) -> TorchFullyShardedDataParallelConfig:
    """The data-parallel wrapper's config. Every run goes through
    TorchFullyShardedDataParallel: --use-torch-fsdp2 shards the model over the
    data-parallel ranks; without it the model is replicated, as Megatron's DDP
    does: FSDP2 on a (replicate, shard) mesh whose shard size is 1, each rank a
    distributed-optimizer instance of its own. Gradients are then all-reduced
    and the mixed-precision policy is the same as when sharded, so the two runs
    differ only by sharding."""
    if not args.use_torch_fsdp2:
        return TorchFullyShardedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            num_distributed_optimizer_instances=args.data_parallel_size,
            # Nothing to gather back with a shard of size 1: keep the compute-dtype copy.
            reshard_after_forward=False, torch_compile=args.torch_compile, cpu_offload=args.optimizer_cpu_offload)
    return TorchFullyShardedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        reshard_after_forward=not args.torch_fsdp2_no_reshard_after_forward,
        accumulate_unsharded_grads_in_no_sync=args.torch_fsdp2_accumulate_unsharded_grads,
        # Our copy kernels are on by default in pretrain() (the log says which serve).
        fsdp_copy_kernels=args.torch_fsdp2_copy_kernels is not False,
        torch_compile=args.torch_compile,
        fp8_param_gather=args.fp8_param_gather,
        cpu_offload=args.optimizer_cpu_offload)


def optimizer_config_from_args(args) -> OptimizerConfig:
    return OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16,
        fp16=args.fp16, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        optimizer_cpu_offload=args.optimizer_cpu_offload)


def scheduler_kwargs_from_args(args) -> dict:
    """Megatron's schedule, counted in samples: warmup and decay lengths given
    in iterations are multiplied by the global batch size."""
    if args.train_samples:
        decay_steps = args.lr_decay_samples or args.train_samples
        wd_incr_steps = args.train_samples
        wsd_steps = args.lr_wsd_decay_samples
        warmup_steps = args.lr_warmup_samples
    else:
        gbs = args.global_batch_size
        decay_steps = (args.lr_decay_iters or args.train_iters) * gbs
        wd_incr_steps = args.train_iters * gbs
        wsd_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters is not None else None
        warmup_steps = args.lr_warmup_iters * gbs
    if args.lr_warmup_fraction is not None:
        warmup_steps = args.lr_warmup_fraction * decay_steps
    return dict(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=wd_incr_steps, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler, wsd_decay_steps=wsd_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style)


def build_configs(args) -> TrainingConfigs:
    """Every config of the run, each validated by its own dataclass (raises
    ValueError/NotImplementedError in the dataclasses' words)."""
    model, ddp = core_transformer_config_from_args(args), ddp_config_from_args(args)
    # The wrapper's plan checks this again for API users.
    check_fp8_param_gather(model, ddp, getattr(ddp, "reshard_after_forward", True))
    return TrainingConfigs(model=model, ddp=ddp, optimizer=optimizer_config_from_args(args),
                           scheduler=scheduler_kwargs_from_args(args))


_IDENTIFIER = re.compile(r"(?<![-\w])[a-z][a-z0-9_]*(?![-\w])")  # not a part of --a-flag
# Config fields whose flag has another name than the field.
_FIELD_FLAGS = {"layernorm_epsilon": "norm_epsilon", "num_moe_experts": "num_experts", "fp8_param": "fp8_param_gather",
                "grad_reduce_in_fp32": "accumulate_allreduce_grads_in_fp32", "gated_linear_unit": "swiglu"}
_CONFIG_FIELDS = {f.name for cls in (TransformerConfig, TorchFullyShardedDataParallelConfig, OptimizerConfig)
                  for f in dataclasses.fields(cls)}


def in_flag_words(message: str, flags: dict[str, str]) -> str:
    """A config's error in the command line's words: each config field named
    in it becomes its flag (`flags`: destination -> option string, from the parser)."""
    def flag(m):
        name = m.group(0)
        dest = _FIELD_FLAGS.get(name, name)
        return flags[dest] if name in _CONFIG_FIELDS and dest in flags else name
    return _IDENTIFIER.sub(flag, message)
