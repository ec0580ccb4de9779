"""Pretrain a GPT model the Megatron way, with megatron_fsdp.

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 \
        --micro-batch-size 4 --global-batch-size 16 --lr 3e-3 --train-iters 40 \
        --mock-data --vocab-size 128 --log-interval 5

Flags are Megatron-LM's. Runs on CPU worker processes with gloo when there is
no GPU, and on CUDA with NCCL when there is. Data parallelism here averages
gradients with an all-reduce over the data-parallel group.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from datetime import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import clip_grad_norm_
from megatron_fsdp.tensor_parallel.utils import local_tensor
from megatron_fsdp.training.mock_data import MockGPTDataset
from megatron_fsdp.transformer import TransformerConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    a = p.add_argument
    a("--tensor-model-parallel-size", type=int, default=1)
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
    a("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    a("--lr-warmup-iters", type=int, default=0)
    a("--lr-decay-iters", type=int, default=None)
    a("--weight-decay", type=float, default=0.01)
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.999)
    a("--adam-eps", type=float, default=1e-8)
    a("--clip-grad", type=float, default=1.0)
    a("--bf16", action="store_true")
    a("--fp16", action="store_true")
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
    if args.fp16:
        parser.error("--fp16 needs a loss scaler, which megatron_fsdp does not provide; use --bf16")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "tensor_model_parallel_size", "log_interval", "make_vocab_size_divisible_by"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
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
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        parser.error(f"--global-batch-size {args.global_batch_size} is not divisible by "
                     f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    if args.sequence_parallel and args.seq_length % tp != 0:
        parser.error(f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
                     f"--tensor-model-parallel-size ({tp})")
    multiple = args.make_vocab_size_divisible_by * tp
    args.padded_vocab_size = int(math.ceil(args.vocab_size / multiple) * multiple)


def learning_rate(args, iteration: int) -> float:
    """Megatron's schedule: linear warmup, then constant / linear / cosine decay to --min-lr."""
    if args.lr_warmup_iters > 0 and iteration <= args.lr_warmup_iters:
        return args.lr * iteration / args.lr_warmup_iters
    if args.lr_decay_style == "constant":
        return args.lr
    decay_iters = args.lr_decay_iters or args.train_iters
    progress = min(1.0, (iteration - args.lr_warmup_iters) / max(1, decay_iters - args.lr_warmup_iters))
    if args.lr_decay_style == "linear":
        coeff = 1.0 - progress
    else:
        coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return args.min_lr + coeff * (args.lr - args.min_lr)


def build_model(args) -> GPTModel:
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, bf16=args.bf16,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
    )
    return GPTModel(
        config, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base)


def average_gradients_over_data_parallel(model: torch.nn.Module) -> None:
    group = parallel_state.get_data_parallel_group()
    world = parallel_state.get_data_parallel_world_size()
    if world == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            grad = local_tensor(p.grad)
            dist.all_reduce(grad, group=group)
            grad.div_(world)


def log_rank_last(message: str) -> None:
    if dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


def train(args) -> list[float]:
    device_type = parallel_state.get_device_type()
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_eps, weight_decay=args.weight_decay)
    dataset = MockGPTDataset(args.vocab_size, args.seq_length, seed=args.seed)
    device = parallel_state.get_device()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    num_micro = args.global_batch_size // (args.micro_batch_size * dp_size)
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.bf16)
    losses = []
    window_start = time.perf_counter()
    for iteration in range(1, args.train_iters + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, iteration)
        consumed = (iteration - 1) * args.global_batch_size
        loss_sum = torch.zeros((), device=device)
        for micro in range(num_micro):
            start = consumed + (micro * dp_size + dp_rank) * args.micro_batch_size
            batch = {k: v.to(device) for k, v in dataset.batch(range(start, start + args.micro_batch_size)).items()}
            with autocast:
                per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            loss = (per_token.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            (loss / num_micro).backward()
            loss_sum += loss.detach()
        average_gradients_over_data_parallel(model)
        grad_norm = clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        dist.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
        lm_loss = loss_sum.item() / (num_micro * dp_size)
        losses.append(lm_loss)
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            steps = iteration % args.log_interval or args.log_interval
            elapsed = (time.perf_counter() - window_start) / steps
            window_start = time.perf_counter()
            tokens_per_s = args.global_batch_size * args.seq_length / elapsed
            log_rank_last(
                f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {iteration * args.global_batch_size:12d} |"
                f" elapsed time per iteration (ms): {elapsed * 1000:.1f} |"
                f" throughput (tokens/s): {tokens_per_s:.1f} |"
                f" learning rate: {learning_rate(args, iteration):.6E} |"
                f" global batch size: {args.global_batch_size:5d} |"
                f" lm loss: {lm_loss:.6E} | loss scale: 1.0 | grad norm: {grad_norm:.3f} |"
                f" number of skipped iterations:   0 | number of nan iterations:   0 |")
    return losses


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)
        torch.manual_seed(args.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        log_rank_last(f"> world size {dist.get_world_size()}: tensor-parallel "
                      f"{args.tensor_model_parallel_size} x data-parallel "
                      f"{parallel_state.get_data_parallel_world_size()} on {parallel_state.get_device_type()}")
        train(args)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
