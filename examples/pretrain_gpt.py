"""Pretrain a GPT model the Megatron way, with megatron_fsdp.

    torchrun --nproc-per-node 4 examples/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --num-layers 2 --hidden-size 64 \
        --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 \
        --micro-batch-size 4 --global-batch-size 16 --lr 3e-3 --train-iters 40 \
        --mock-data --vocab-size 128 --log-interval 5

Flags are Megatron-LM's. Runs on CPU worker processes with gloo when there is
no GPU, and on CUDA with NCCL when there is. With --use-torch-fsdp2 the model
is sharded by TorchFullyShardedDataParallel (ZeRO-3, or ZeRO-2 with
--torch-fsdp2-no-reshard-after-forward); without it, data-parallel replicas
average their gradients with an all-reduce. --save/--load write and read
resharding DCP checkpoints (--ckpt-format torch_dcp).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from datetime import datetime

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.training.checkpointing import load_checkpoint, read_latest_iteration, save_checkpoint
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_fsdp.tensor_parallel.utils import local_tensor
from megatron_fsdp.training.initialize import distributed_job
from megatron_fsdp.training.mock_data import MockGPTDataset
from megatron_fsdp.transformer import TransformerConfig


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    a = p.add_argument
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--use-torch-fsdp2", action="store_true")
    a("--torch-fsdp2-no-reshard-after-forward", action="store_true")
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
    a("--lr-warmup-init", type=float, default=0.0)
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
                                     or args.num_distributed_optimizer_instances > 1):
        parser.error("--torch-fsdp2-no-reshard-after-forward and --num-distributed-optimizer-instances "
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
    if args.sequence_parallel and args.seq_length % tp != 0:
        parser.error(f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by "
                     f"--tensor-model-parallel-size ({tp})")
    multiple = args.make_vocab_size_divisible_by * tp
    args.padded_vocab_size = int(math.ceil(args.vocab_size / multiple) * multiple)


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
    model = GPTModel(
        config, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base)
    if not args.use_torch_fsdp2:
        return model
    ddp_config = TorchFullyShardedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        reshard_after_forward=not args.torch_fsdp2_no_reshard_after_forward)
    return TorchFullyShardedDataParallel(config, ddp_config, model)


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


def build_optimizer(args, model):
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16), model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters or args.train_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay)
    return optimizer, scheduler


def maybe_load(args, model, optimizer, scheduler) -> int:
    """The iteration to resume after (0 for a fresh start), as Megatron's --load does."""
    if not args.load or read_latest_iteration(args.load) is None:
        if args.load:
            log_rank_last(f"> no checkpoint found in {args.load}: training from scratch")
        return 0
    loaded = load_checkpoint(model, optimizer, scheduler, args.load,
                             load_optim=not args.no_load_optim, load_rng=not args.no_load_rng)
    log_rank_last(f"> loaded checkpoint from {args.load} at iteration {loaded['iteration']}"
                  + ("" if loaded["rng_restored"] else " (RNG states not restored: other layout)"))
    return loaded["iteration"]


def train_step(args, model, optimizer, dataset, iteration, num_micro) -> tuple[float, float]:
    device = parallel_state.get_device()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    autocast = torch.autocast(parallel_state.get_device_type(), dtype=torch.bfloat16,
                              enabled=args.bf16 and not args.use_torch_fsdp2)
    consumed = (iteration - 1) * args.global_batch_size
    loss_sum = torch.zeros((), device=device)
    for micro in range(num_micro):
        start = consumed + (micro * dp_size + dp_rank) * args.micro_batch_size
        batch = {k: v.to(device) for k, v in dataset.batch(range(start, start + args.micro_batch_size)).items()}
        # FSDP: reduce-scatter only after the last microbatch (Megatron's no_sync schedule).
        accumulate = args.use_torch_fsdp2 and micro < num_micro - 1
        with model.no_sync() if accumulate else contextlib.nullcontext(), autocast:
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            loss = (per_token.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            (loss / num_micro).backward()
        loss_sum += loss.detach()
    if args.use_torch_fsdp2:
        model.finish_grad_sync()
    else:
        average_gradients_over_data_parallel(model)
    _, grad_norm, _ = optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
    return loss_sum.item() / (num_micro * dp_size), grad_norm


def train(args) -> list[float]:
    model = build_model(args)
    optimizer, scheduler = build_optimizer(args, model)
    start_iteration = maybe_load(args, model, optimizer, scheduler)
    dataset = MockGPTDataset(args.vocab_size, args.seq_length, seed=args.seed)
    num_micro = args.global_batch_size // (args.micro_batch_size * parallel_state.get_data_parallel_world_size())
    losses = []
    window_start = time.perf_counter()
    for iteration in range(start_iteration + 1, args.train_iters + 1):
        learning_rate = optimizer.param_groups[0]["lr"]
        lm_loss, grad_norm = train_step(args, model, optimizer, dataset, iteration, num_micro)
        scheduler.step()
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
                f" learning rate: {learning_rate:.6E} |"
                f" global batch size: {args.global_batch_size:5d} |"
                f" lm loss: {lm_loss:.6E} | loss scale: 1.0 | grad norm: {grad_norm:.3f} |"
                f" number of skipped iterations:   0 | number of nan iterations:   0 |")
        if args.save and (iteration == args.train_iters or
                          (args.save_interval and iteration % args.save_interval == 0)):
            path = save_checkpoint(iteration, model, optimizer, scheduler, args.save)
            log_rank_last(f"> saved checkpoint {path}")
    return losses


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group(backend)
    with distributed_job():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
        torch.manual_seed(args.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        log_rank_last(f"> world size {dist.get_world_size()}: tensor-parallel "
                      f"{args.tensor_model_parallel_size} x data-parallel "
                      f"{parallel_state.get_data_parallel_world_size()} on {parallel_state.get_device_type()}")
        train(args)


if __name__ == "__main__":
    sys.exit(main())
