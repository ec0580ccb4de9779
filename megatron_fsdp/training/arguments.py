"""Megatron-LM's command-line flags for the pretraining script (the ones megatron_fsdp supports).

Parsing and every check run on each rank before any process group exists,
so a bad flag fails every rank alike, before any work. A mistake prints one
line, on rank 0 only (not a usage block and a traceback per rank), and exits
with code 2, argparse's code for a usage error.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    p = _OneLineErrors(description="Pretrain a GPT model the Megatron way, with megatron_fsdp.",
                       allow_abbrev=False)
    a = p.add_argument
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--use-torch-fsdp2", action="store_true")
    a("--torch-fsdp2-no-reshard-after-forward", action="store_true")
    # Not a Megatron flag: Megatron's FSDP2 path always reduce-scatters each microbatch.
    a("--torch-fsdp2-accumulate-unsharded-grads", action="store_true")
    a("--num-distributed-optimizer-instances", type=int, default=1)
    a("--use-distributed-optimizer", action="store_true")
    a("--accumulate-allreduce-grads-in-fp32", action="store_true")
    a("--grad-reduce-in-bf16", action="store_true")
    a("--overlap-grad-reduce", action="store_true")
    a("--overlap-param-gather", action="store_true")
    a("--save", default=None)
    a("--load", default=None)
    a("--save-interval", type=int, default=None)
    a("--ckpt-format", default="torch_dcp")
    a("--no-load-optim", action="store_true")
    a("--no-load-rng", action="store_true")
    a("--exit-on-missing-checkpoint", action="store_true")
    a("--no-verify-checkpoint", action="store_true")
    a("--override-opt-param-scheduler", action="store_true")
    a("--use-checkpoint-opt-param-scheduler", action="store_true")
    a("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false")
    a("--exit-signal-handler", action="store_true")
    a("--exit-interval", type=int, default=None)
    a("--exit-duration-in-mins", type=float, default=None)
    a("--distributed-timeout-minutes", type=float, default=10)
    a("--sequence-parallel", action="store_true")
    a("--num-layers", type=int, required=True)
    a("--hidden-size", type=int, required=True)
    a("--ffn-hidden-size", type=int, default=None)
    a("--num-attention-heads", type=int, required=True)
    a("--group-query-attention", action="store_true")
    a("--num-query-groups", type=int, default=1)
    a("--kv-channels", type=int, default=None)
    a("--seq-length", type=int, required=True)
    a("--max-position-embeddings", type=int, default=None)
    a("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default="learned_absolute")
    a("--rotary-percent", type=float, default=1.0)
    a("--rotary-base", type=int, default=10000)
    a("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    a("--norm-epsilon", type=float, default=1e-5)
    a("--swiglu", action="store_true")
    a("--disable-bias-linear", action="store_true")
    a("--untie-embeddings-and-output-weights", action="store_true")
    a("--hidden-dropout", type=float, default=0.1)
    a("--attention-dropout", type=float, default=0.1)
    a("--init-method-std", type=float, default=0.02)
    a("--recompute-granularity", choices=["full", "selective"], default=None)
    a("--recompute-method", choices=["uniform", "block"], default=None)
    a("--recompute-num-layers", type=int, default=None)
    a("--micro-batch-size", type=int, required=True)
    a("--global-batch-size", type=int, default=None)
    a("--train-iters", type=int, required=True)
    a("--lr", type=float, required=True)
    a("--min-lr", type=float, default=0.0)
    a("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], default="linear")
    a("--lr-wsd-decay-iters", type=int, default=None)
    a("--lr-wsd-decay-style", choices=["linear", "cosine", "exponential", "minus_sqrt"], default="exponential")
    a("--lr-warmup-iters", type=int, default=0)
    a("--lr-warmup-init", type=float, default=0.0)
    a("--lr-decay-iters", type=int, default=None)
    a("--weight-decay", type=float, default=0.01)
    a("--start-weight-decay", type=float, default=None)
    a("--end-weight-decay", type=float, default=None)
    a("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant")
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--adam-eps", type=float, default=1e-8)
    a("--clip-grad", type=float, default=1.0)
    a("--bf16", action="store_true")
    a("--fp16", action="store_true")
    a("--loss-scale", type=float, default=None)
    a("--initial-loss-scale", type=float, default=2 ** 32)
    a("--min-loss-scale", type=float, default=1.0)
    a("--loss-scale-window", type=float, default=1000)
    a("--hysteresis", type=int, default=2)
    a("--seed", type=int, default=1234)
    a("--mock-data", action="store_true")
    a("--tokenizer-type", default="NullTokenizer", choices=["NullTokenizer"])
    a("--vocab-size", type=int, default=None)
    a("--make-vocab-size-divisible-by", type=int, default=128)
    a("--log-interval", type=int, default=100)
    a("--distributed-backend", choices=["nccl", "gloo"], default=None)
    args = p.parse_args(argv)
    _validate(p, args)
    return args


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    # Checked on every rank before any process group exists: all ranks fail alike.
    if not args.mock_data:
        parser.error("only --mock-data is supported as a data source")
    if args.vocab_size is None or args.vocab_size < 2:
        parser.error("--vocab-size (>= 2) is required with --mock-data and --tokenizer-type NullTokenizer")
    if args.fp16 and args.bf16:
        parser.error("--fp16 and --bf16 exclude each other")
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
    for name in ("exit_interval", "exit_duration_in_mins"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "tensor_model_parallel_size", "log_interval", "make_vocab_size_divisible_by"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
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
    if not args.use_torch_fsdp2 and (args.torch_fsdp2_no_reshard_after_forward
                                     or args.torch_fsdp2_accumulate_unsharded_grads
                                     or args.num_distributed_optimizer_instances > 1):
        parser.error("--torch-fsdp2-no-reshard-after-forward, --torch-fsdp2-accumulate-unsharded-grads and "
                     "--num-distributed-optimizer-instances "
                     "need --use-torch-fsdp2")
    if args.lr <= 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        parser.error(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                     f"{args.max_position_embeddings}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    tp = args.tensor_model_parallel_size
    if world_size % tp != 0:
        parser.error(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}")
    dp = world_size // tp
    if dp % args.num_distributed_optimizer_instances != 0:
        parser.error(f"data-parallel size {dp} is not divisible by --num-distributed-optimizer-instances "
                     f"{args.num_distributed_optimizer_instances}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        parser.error(f"--global-batch-size {args.global_batch_size} is not divisible by "
                     f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    if args.sequence_parallel and tp == 1:
        # Megatron turns it off with a warning: there is nothing to split.
        if int(os.environ.get("RANK", "0")) == 0:
            warnings.warn("--sequence-parallel has no effect at --tensor-model-parallel-size 1; turning it off",
                          stacklevel=2)
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % tp != 0:
        parser.error(f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
                     f"--tensor-model-parallel-size ({tp})")
    multiple = args.make_vocab_size_divisible_by * tp
    args.padded_vocab_size = int(math.ceil(args.vocab_size / multiple) * multiple)
