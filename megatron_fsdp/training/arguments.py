"""Megatron-LM's command-line flags for the pretraining script (the ones megatron_fsdp supports).

Parsing and every check run on each rank before any process group exists,
so a bad flag fails every rank alike, before any work. A mistake prints one
line, on rank 0 only (not a usage block and a traceback per rank), and exits
with code 2, argparse's code for a usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import warnings
from typing import Optional

from .argument_groups import add_megatron_arguments
from .configs import build_configs, core_transformer_config_from_args, in_flag_words  # noqa: F401


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def parse_args(argv=None, extra_args_provider=None, defaults: Optional[dict] = None) -> argparse.Namespace:
    """Parse and check `argv` (sys.argv[1:] by default). As in Megatron-LM,
    `extra_args_provider(parser)` may add a script's own flags (and returns the
    parser) and `defaults` overrides flag defaults by destination name."""
    p = _OneLineErrors(description="Pretrain a GPT model the Megatron way, with megatron_fsdp.",
                       allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_megatron_arguments(p)
    if extra_args_provider is not None:
        p = extra_args_provider(p)
    if defaults:
        p.set_defaults(**defaults)
    words = sys.argv[1:] if argv is None else argv
    stored = _checkpoint_args(p, words)
    if stored:
        # The stored flags stand in for required ones the command line leaves out.
        for action in p._actions:
            if action.dest in stored:
                action.required = False
    args = p.parse_args(argv)
    if stored:
        from .checkpointing import RUN_DEFAULT_ARGS  # here: checkpointing imports DCP, --help does not need it
    for name, value in (stored or {}).items():
        given = getattr(args, name, value)
        if name in RUN_DEFAULT_ARGS and _on_command_line(p, words, name):
            continue  # the command line's own, as Megatron-LM keeps it
        if given != value and int(os.environ.get("RANK", "0")) == 0:
            flag = f"--{name.replace('_', '-')}"
            instead = (f"(none on the command line: give {flag} for another)" if name in RUN_DEFAULT_ARGS
                       else f"replaces {given!r}")
            print(f"> --use-checkpoint-args: {flag} {value!r} from the checkpoint {instead}", flush=True)
        setattr(args, name, value)
    _validate(p, args)
    return args


def _on_command_line(parser, argv, dest: str) -> bool:
    """Whether `argv` gives the flag of destination `dest` (its default value included)."""
    options = {o for action in parser._actions if action.dest == dest for o in action.option_strings}
    return any(word.split("=", 1)[0] in options for word in argv)


def _checkpoint_args(parser, argv) -> Optional[dict]:
    """Megatron-LM's --use-checkpoint-args: the model flags stored in --load's latest checkpoint
    (training state saved by pretrain(), or written by tools/checkpoint/convert.py), read by each
    rank from the files, before any process group exists. None without the flag."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--use-checkpoint-args", action="store_true")
    pre.add_argument("--load", default=None)
    known, _ = pre.parse_known_args(argv)
    if not known.use_checkpoint_args:
        return None
    if not known.load:
        parser.error("--use-checkpoint-args needs --load")
    from .offline_checkpoint import stored_model_args

    try:
        return stored_model_args(known.load)
    except Exception as exc:  # CheckpointError, OSError: one line, as any flag error
        parser.error(f"--use-checkpoint-args: {exc}")


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rules about flags themselves (required, exclusive, needing another
    flag, files and packages), Megatron-LM's derived defaults, then every
    config built once (training/configs.py): a value's own rules are its
    dataclass's, reported here as a flag error. Checked on every rank before
    any process group exists: all ranks fail alike."""
    # (Required here, not by argparse, so that a script's `defaults` can supply them.)
    missing = [f"--{n.replace('_', '-')}" for n in ("micro_batch_size", "lr") if getattr(args, n) is None]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    if args.weight_decay_incr_style == "constant":
        if args.start_weight_decay is not None or args.end_weight_decay is not None:
            parser.error("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    elif args.start_weight_decay is None or args.end_weight_decay is None:
        parser.error(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay "
                     "and --end-weight-decay")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        parser.error("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler exclude each other")
    if args.distributed_timeout_minutes <= 0:
        parser.error(f"--distributed-timeout-minutes must be positive, got {args.distributed_timeout_minutes}")
    for name in ("exit_interval", "exit_duration_in_mins", "train_iters", "train_samples", "eval_interval"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    # The training loop's own numbers (the model's are TransformerConfig's).
    for name in ("seq_length", "micro_batch_size", "log_interval", "make_vocab_size_divisible_by",
                 "tensorboard_log_interval", "tensorboard_queue_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("eval_iters", "num_workers", "vocab_extra_ids"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    # Megatron: with --bf16, gradients are accumulated and reduced in fp32
    # unless --grad-reduce-in-bf16 asks otherwise.
    if args.bf16 and not args.grad_reduce_in_bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if not args.use_torch_fsdp2 and (args.use_distributed_optimizer or args.overlap_grad_reduce
                                     or args.overlap_param_gather or args.accumulate_allreduce_grads_in_fp32
                                     and not args.bf16):
        parser.error("--use-distributed-optimizer, --overlap-grad-reduce, --overlap-param-gather and "
                     "--accumulate-allreduce-grads-in-fp32 need --use-torch-fsdp2")
    if args.ckpt_format != "torch_dcp":
        parser.error(f"--ckpt-format {args.ckpt_format} is not supported: megatron_fsdp writes torch_dcp")
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        parser.error("--save-interval needs --save and a value >= 1")
    if args.async_save and not args.save:
        parser.error("--async-save needs --save")
    args.use_persistent_ckpt_worker = args.use_persistent_ckpt_worker or args.async_save  # Megatron needs both
    if not args.use_torch_fsdp2 and (args.torch_fsdp2_no_reshard_after_forward
                                     or args.torch_fsdp2_accumulate_unsharded_grads
                                     or args.torch_fsdp2_copy_kernels is not None
                                     or args.num_distributed_optimizer_instances != 1):
        parser.error("--torch-fsdp2-no-reshard-after-forward, --torch-fsdp2-accumulate-unsharded-grads, "
                     "--[no-]torch-fsdp2-copy-kernels and --num-distributed-optimizer-instances "
                     "need --use-torch-fsdp2")
    _validate_model(parser, args)
    _validate_schedule(parser, args)
    _validate_data(parser, args)
    _validate_logging(parser, args)
    _validate_fp8(parser, args)
    _validate_parallel_and_batch(parser, args)
    _validate_profiling(parser, args)
    # Every config, once: the model's rules (sizes, heads, query groups and FFN vs TP, dropouts,
    # recomputation, fusions, fp8), the optimizer's (learning rate, loss scaling), the wrapper's.
    # Building them does no communication and touches no device.
    flags = {action.dest: action.option_strings[0] for action in reversed(parser._actions)
             if action.option_strings}
    try:
        args.configs = build_configs(args)
    except (ValueError, NotImplementedError) as exc:
        parser.error(in_flag_words(str(exc), flags))
    args.kv_channels = args.configs.model.kv_channels  # TransformerConfig's default: hidden / heads
    _validate_rope(parser, args)


def _validate_model(parser, args) -> None:
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        parser.error(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                     f"{args.max_position_embeddings}")
    if args.ffn_hidden_size is None and args.hidden_size >= 1:
        # Megatron's default; with SwiGLU it keeps the parameter count of a 4h GELU MLP.
        args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 if args.swiglu else 4 * args.hidden_size
        if args.ffn_hidden_size < 1:
            parser.error(f"--swiglu with --hidden-size {args.hidden_size} gives Megatron's default FFN size 0: "
                         "set --ffn-hidden-size")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads


def _validate_rope(parser, args) -> None:
    """The rotary embedding's flags (GPTModel's arguments, not TransformerConfig's)."""
    if args.position_embedding_type == "rope":
        if not 0.0 < args.rotary_percent <= 1.0:
            parser.error(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
        dim = int(args.kv_channels * args.rotary_percent)
        if dim < 2 or dim % 2 != 0:
            parser.error(f"RoPE rotates kv-channels x --rotary-percent = {args.kv_channels} x "
                         f"{args.rotary_percent} = {dim} dimensions: it must be a positive even number")


def _validate_parallel_and_batch(parser, args) -> None:
    args.world_size = world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    tp = args.tensor_model_parallel_size
    if not isinstance(tp, int) or tp < 1:
        return  # TransformerConfig's error (built next), in the flags' words
    cp = args.context_parallel_size
    if not isinstance(cp, int) or cp < 1:
        parser.error(f"--context-parallel-size must be a positive integer, got {cp!r}")
    if world_size % tp != 0:
        parser.error(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}")
    if world_size % (tp * cp) != 0:
        parser.error(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                     f"--context-parallel-size {cp}")
    args.data_parallel_size = dp = world_size // (tp * cp)
    if args.num_distributed_optimizer_instances >= 1 and dp % args.num_distributed_optimizer_instances != 0:
        parser.error(f"data-parallel size {dp} is not divisible by --num-distributed-optimizer-instances "
                     f"{args.num_distributed_optimizer_instances}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp) != 0 and not args.decrease_batch_size_if_needed:
        parser.error(f"--global-batch-size {args.global_batch_size} is not divisible by "
                     f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    if args.global_batch_size < args.micro_batch_size * dp:
        parser.error(f"--global-batch-size {args.global_batch_size} is smaller than --micro-batch-size "
                     f"{args.micro_batch_size} x data-parallel size {dp}")
    if args.rampup_batch_size is not None:
        start, increment, samples = args.rampup_batch_size
        if start < 1 or increment < 1 or samples < 0:
            parser.error(f"--rampup-batch-size needs START >= 1, INCREMENT >= 1, SAMPLES >= 0, got "
                         f"{args.rampup_batch_size}")
        if start > args.global_batch_size or (args.global_batch_size - start) % increment != 0:
            parser.error(f"--rampup-batch-size: --global-batch-size {args.global_batch_size} minus START {start} "
                         f"must be a non-negative multiple of INCREMENT {increment}")
    if args.sequence_parallel and tp == 1:
        # Megatron turns it off with a warning: there is nothing to split.
        if args.rank == 0:
            warnings.warn("--sequence-parallel has no effect at --tensor-model-parallel-size 1; turning it off",
                          stacklevel=3)
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % tp != 0:
        parser.error(f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
                     f"--tensor-model-parallel-size ({tp})")
    _validate_context_parallel(parser, args, tp, cp)
    _validate_experts(parser, args, tp)


def _validate_context_parallel(parser, args, tp: int, cp: int) -> None:
    """Megatron-LM's rules for --context-parallel-size and --cp-comm-type, before any collective."""
    kinds = args.cp_comm_type
    if len(kinds) not in (1, args.num_layers):
        parser.error(f"--cp-comm-type takes one value or one per layer ({args.num_layers}), got {len(kinds)}")
    args.cp_comm_type = kinds[0] if len(kinds) == 1 else list(kinds)
    sizes = args.hierarchical_context_parallel_sizes
    if sizes is not None and "a2a+p2p" not in kinds:
        parser.error("--hierarchical-context-parallel-sizes goes with --cp-comm-type a2a+p2p")
    if "a2a+p2p" in kinds and (sizes is None or len(sizes) != 2 or math.prod(sizes) != cp or min(sizes) < 1):
        parser.error(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A R: the a2a and p2p "
                     f"group sizes, positive, with A x R = --context-parallel-size ({cp}); got {sizes}")
    if cp == 1:
        return
    split = 2 * cp * (tp if args.sequence_parallel else 1)
    if args.seq_length % split != 0:
        parser.error(f"--context-parallel-size {cp} needs --seq-length ({args.seq_length}) divisible by 2 x "
                     f"--context-parallel-size" + (" x --tensor-model-parallel-size with --sequence-parallel"
                                                    if args.sequence_parallel else "") + f" ({split})")
    if args.reset_attention_mask:
        parser.error("--reset-attention-mask is not supported with --context-parallel-size > 1 (context-parallel "
                     "attention is causal, without an explicit mask)")
    if not args.use_torch_fsdp2:
        parser.error("--context-parallel-size > 1 needs --use-torch-fsdp2: the replicated layout (a copy of the "
                     "model on every rank) is not supported with context parallelism yet")
    if args.num_distributed_optimizer_instances > 1:
        parser.error("--context-parallel-size > 1 with --num-distributed-optimizer-instances > 1 (HSDP) is not "
                     "supported: FSDP shards over the flattened data- and context-parallel ranks")


def _validate_experts(parser, args, tp: int) -> None:
    """Megatron-LM's rules for --expert-model-parallel-size and --expert-tensor-parallel-size (the MoE
    fields' own rules are TransformerConfig's, reported in the flags' words)."""
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    for flag, value in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be a positive integer, got {value}")
    if args.num_experts is None:
        if ep > 1 or etp is not None:
            parser.error("--expert-model-parallel-size and --expert-tensor-parallel-size need --num-experts")
        return
    if not args.disable_bias_linear:
        parser.error("--num-experts needs --disable-bias-linear: mixture-of-experts layers have no biases here")
    etp = tp if etp is None else etp
    if args.world_size % (etp * ep) != 0:
        parser.error(f"world size {args.world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
                     f"--expert-model-parallel-size {ep}")
    if not args.use_torch_fsdp2:
        parser.error("--num-experts needs --use-torch-fsdp2: the replicated layout (a copy of the model on every "
                     "rank) is not supported with mixture-of-experts layers")
    if ep > 1 and args.num_distributed_optimizer_instances > 1:
        parser.error("--expert-model-parallel-size > 1 with --num-distributed-optimizer-instances > 1 (HSDP) is "
                     "not supported: the experts shard over their whole data-parallel group")


def _validate_schedule(parser, args) -> None:
    """Megatron's two ways to say how long to train: iterations or samples."""
    if (args.train_iters is None) == (args.train_samples is None):
        parser.error("give exactly one of --train-iters and --train-samples")
    if args.train_iters is not None:
        for name in ("lr_decay_samples", "lr_wsd_decay_samples"):
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')} needs --train-samples (with --train-iters use the "
                             "-iters flag)")
        if args.lr_warmup_samples:
            parser.error("--lr-warmup-samples needs --train-samples (with --train-iters use --lr-warmup-iters)")
        if args.rampup_batch_size is not None:
            # As Megatron: a ramp-up is defined in samples.
            parser.error("--rampup-batch-size needs --train-samples, not --train-iters")
    else:
        for name in ("lr_decay_iters", "lr_wsd_decay_iters"):
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')} needs --train-iters (with --train-samples use the "
                             "-samples flag)")
        if args.lr_warmup_iters:
            parser.error("--lr-warmup-iters needs --train-iters (with --train-samples use --lr-warmup-samples)")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        parser.error("--lr-warmup-fraction excludes --lr-warmup-iters and --lr-warmup-samples")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        parser.error(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")


def _validate_data(parser, args) -> None:
    per_split = args.train_data_path or args.valid_data_path or args.test_data_path
    sources = [name for name, given in (("--mock-data", args.mock_data), ("--data-path", args.data_path),
                                        ("--train/valid/test-data-path", per_split),
                                        ("--per-split-data-args-path", args.per_split_data_args_path)) if given]
    if len(sources) != 1:
        parser.error("give exactly one data source: --mock-data, --data-path, --train-data-path/"
                     f"--valid-data-path/--test-data-path or --per-split-data-args-path (got {sources or 'none'})")
    if args.split is not None and not args.data_path:
        parser.error("--split applies to --data-path only")
    if args.data_path and args.split is None:
        args.split = "969, 30, 1"
    if args.split is not None:
        _check_split(parser, args.split)
    needs = {"NullTokenizer": ("vocab_size",), "GPT2BPETokenizer": ("vocab_file", "merge_file"),
             "HuggingFaceTokenizer": ("tokenizer_model",)}[args.tokenizer_type]
    missing = [f"--{n.replace('_', '-')}" for n in needs if getattr(args, n) is None]
    if missing:
        parser.error(f"--tokenizer-type {args.tokenizer_type} needs {' and '.join(missing)}")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size < 2:
        parser.error(f"--vocab-size must be >= 2, got {args.vocab_size}")
    # Set from the tokenizer's vocabulary when the tokenizer is built.
    args.padded_vocab_size = None


def _check_split(parser, split: str) -> None:
    # The dataset config parses --split only once the process groups are up, on every rank: a bad
    # value found there is a traceback per rank. Parsing it here makes it a flag error like the others.
    from ..datasets.blended_megatron_dataset_config import parse_and_normalize_split
    try:
        parse_and_normalize_split(split)
    except ValueError as err:
        parser.error(str(err))


def _validate_logging(parser, args) -> None:
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard-dir needs the tensorboard package (pip install tensorboard)")
    if args.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        parser.error("--wandb-project needs the wandb package (pip install wandb)")
    for flag in ("log_timers_to_tensorboard", "log_validation_ppl_to_tensorboard", "log_memory_to_tensorboard",
                 "log_world_size_to_tensorboard"):
        if getattr(args, flag) and args.tensorboard_dir is None and args.wandb_project is None:
            parser.error(f"--{flag.replace('_', '-')} needs --tensorboard-dir or --wandb-project")
    if (args.wandb_exp_name or args.wandb_save_dir) and args.wandb_project is None:
        parser.error("--wandb-exp-name and --wandb-save-dir need --wandb-project")


def _validate_profiling(parser, args) -> None:
    """Megatron-LM's profiling flags (training/profiling.py): the window and the ranks, checked before
    any work, and no flag that would have nothing to do."""
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0:
        parser.error(f"--profile-step-start must be >= 0, got {start}")
    if end <= start:
        parser.error(f"--profile-step-end ({end}) must be greater than --profile-step-start ({start}): the "
                     f"profiled iterations are start..end-1")
    outside = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
    if outside:
        parser.error(f"--profile-ranks: {outside[0]} is not a rank of this job (0..{args.world_size - 1})")
    needs = [(args.use_pytorch_profiler, "--use-pytorch-profiler", args.profile, "--profile"),
             (args.pytorch_profiler_collect_shapes, "--pytorch-profiler-collect-shapes", args.profile, "--profile"),
             (args.pytorch_profiler_collect_callstack, "--pytorch-profiler-collect-callstack",
              args.use_pytorch_profiler, "--use-pytorch-profiler"),
             (args.profile_dir is not None, "--profile-dir", args.use_pytorch_profiler, "--use-pytorch-profiler")]
    for given, flag, present, needed in needs:
        if given and not present:
            parser.error(f"{flag} needs {needed}")
    if args.use_pytorch_profiler and args.profile_dir is None and args.tensorboard_dir is None:
        parser.error("--use-pytorch-profiler writes its traces into --tensorboard-dir (as Megatron-LM) or "
                     "--profile-dir: give one")
    if args.flight_recorder_buffer_size is not None and args.flight_recorder_buffer_size < 0:
        parser.error(f"--flight-recorder-buffer-size must be >= 0, got {args.flight_recorder_buffer_size}")


def _validate_fp8(parser, args) -> None:
    if args.fp8 is None:
        given = [f for f, default in (("--fp8-recipe", "delayed"), ("--fp8-margin", 0), ("--fp8-amax-history-len", 1),
                                      ("--fp8-amax-compute-algo", "most_recent"), ("--no-fp8-wgrad", True),
                                      ("--first-last-layers-bf16", False), ("--fp8-param-gather", False))
                 if getattr(args, f.lstrip("-").replace("no-", "").replace("-", "_")) != default]
        if given:
            parser.error(f"{', '.join(given)} need --fp8-format")
        return
    if args.fp8_param_gather and not args.use_torch_fsdp2:
        parser.error("--fp8-param-gather needs --use-torch-fsdp2")
