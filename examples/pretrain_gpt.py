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

import contextlib
import dataclasses
import math
import os
import sys
import time
from datetime import datetime, timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_fsdp.tensor_parallel.utils import local_tensor
from megatron_fsdp.training.arguments import parse_args
from megatron_fsdp.training.dist_signal_handler import DistributedSignalHandler
from megatron_fsdp.training.initialize import distributed_job
from megatron_fsdp.training.mock_data import MockGPTDataset
from megatron_fsdp.training.nan_check import check_for_nan_in_loss_and_grad
from megatron_fsdp.training.progress import CollectiveTimeoutError, ProgressBeacon, is_timeout
from megatron_fsdp.transformer import TransformerConfig


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
        init_method_std=args.init_method_std, bf16=args.bf16, fp16=args.fp16,
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
        reshard_after_forward=not args.torch_fsdp2_no_reshard_after_forward,
        accumulate_unsharded_grads_in_no_sync=args.torch_fsdp2_accumulate_unsharded_grads)
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
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, bf16=args.bf16,
        fp16=args.fp16, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis), model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters or args.train_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=args.lr_wsd_decay_iters, lr_wsd_decay_style=args.lr_wsd_decay_style)
    return optimizer, scheduler


def maybe_load(args, model, optimizer, scheduler) -> int:
    """The iteration to resume after (0 for a fresh start), as Megatron's --load does."""
    if not args.load:
        return 0
    loaded = load_checkpoint(model, optimizer, scheduler, args.load,
                             load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                             true_vocab_size=args.vocab_size, verify=not args.no_verify_checkpoint,
                             exit_on_missing_checkpoint=args.exit_on_missing_checkpoint)
    if loaded.get("missing"):
        log_rank_last(f"> WARNING: {loaded['missing']}: training from scratch")
        return 0
    log_rank_last(f"> loaded checkpoint from {args.load} at iteration {loaded['iteration']}"
                  + ("" if loaded["rng_restored"] else " (RNG states not restored: other layout)"))
    return loaded["iteration"]


def save(args, iteration, model, optimizer, scheduler) -> None:
    path = save_checkpoint(iteration, model, optimizer, scheduler, args.save, true_vocab_size=args.vocab_size,
                           extra_state={"consumed_train_samples": iteration * args.global_batch_size})
    log_rank_last(f"> saved checkpoint {path}")


@dataclasses.dataclass
class StepResult:
    lm_loss: float
    grad_norm: Optional[float]
    update_successful: bool
    nan: bool


def train_step(args, model, optimizer, dataset, iteration, num_micro, beacon) -> StepResult:
    device = parallel_state.get_device()
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    low_precision = torch.float16 if args.fp16 else torch.bfloat16
    autocast = torch.autocast(parallel_state.get_device_type(), dtype=low_precision,
                              enabled=(args.bf16 or args.fp16) and not args.use_torch_fsdp2)
    consumed = (iteration - 1) * args.global_batch_size
    loss_sum = torch.zeros((), device=device)
    for micro in range(num_micro):
        beacon.mark(f"iteration {iteration}: forward/backward of microbatch {micro}")
        start = consumed + (micro * dp_size + dp_rank) * args.micro_batch_size
        batch = {k: v.to(device) for k, v in dataset.batch(range(start, start + args.micro_batch_size)).items()}
        # Megatron's schedule: the last microbatch's backward outside no_sync().
        accumulate = args.use_torch_fsdp2 and micro < num_micro - 1
        with model.no_sync() if accumulate else contextlib.nullcontext(), autocast:
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            loss = (per_token.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
            optimizer.scale_loss(loss / num_micro).backward()
        loss_sum += loss.detach()
    beacon.mark(f"iteration {iteration}: gradient reduction and checks")
    if args.use_torch_fsdp2:
        model.finish_grad_sync()
    else:
        average_gradients_over_data_parallel(model)
    if args.check_for_nan_in_loss_and_grad:
        # With fp16 an overflowing gradient is the loss scaler's business: it skips the step.
        grads = None if args.fp16 else [p.grad for p in model.parameters() if p.grad is not None]
        check_for_nan_in_loss_and_grad(iteration, loss_sum, grads)
    beacon.mark(f"iteration {iteration}: optimizer step")
    update_successful, grad_norm, _ = optimizer.step()
    optimizer.zero_grad()
    beacon.mark(f"iteration {iteration}: loss all-reduce")
    dist.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
    lm_loss = loss_sum.item() / (num_micro * dp_size)
    nan = not math.isfinite(lm_loss) or (grad_norm is not None and not math.isfinite(grad_norm))
    return StepResult(lm_loss, grad_norm, update_successful, nan)


def should_exit(args, iteration, signal_handler, train_start) -> Optional[str]:
    """Why every rank stops after this iteration (the same answer on all ranks), or None."""
    if signal_handler is not None and any(signal_handler.signals_received()):
        return "a rank received SIGTERM (--exit-signal-handler)"
    if args.exit_interval and iteration % args.exit_interval == 0:
        return f"--exit-interval {args.exit_interval}"
    if args.exit_duration_in_mins:
        over = torch.tensor([float(time.time() - train_start > 60 * args.exit_duration_in_mins)],
                            device=parallel_state.get_device())
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if over.item() > 0:
            return f"--exit-duration-in-mins {args.exit_duration_in_mins}"
    return None


def train(args, beacon: ProgressBeacon) -> list[float]:
    train_start = time.time()
    beacon.mark("model and optimizer construction")
    model = build_model(args)
    optimizer, scheduler = build_optimizer(args, model)
    beacon.mark("checkpoint load")
    start_iteration = maybe_load(args, model, optimizer, scheduler)
    dataset = MockGPTDataset(args.vocab_size, args.seq_length, seed=args.seed)
    num_micro = args.global_batch_size // (args.micro_batch_size * parallel_state.get_data_parallel_world_size())
    losses = []
    window = dict(start=time.perf_counter(), losses=[], skipped=0, nan=0)
    with DistributedSignalHandler() if args.exit_signal_handler else contextlib.nullcontext() as signal_handler:
        for iteration in range(start_iteration + 1, args.train_iters + 1):
            learning_rate = optimizer.param_groups[0]["lr"]
            step = train_step(args, model, optimizer, dataset, iteration, num_micro, beacon)
            if step.update_successful:
                scheduler.step()  # Megatron does not advance the schedule on a skipped step
            losses.append(step.lm_loss)
            window["losses"].append(step.lm_loss)
            window["skipped"] += int(not step.update_successful)
            window["nan"] += int(step.nan)
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                log_iteration(args, iteration, learning_rate, step, optimizer, window)
            beacon.mark(f"iteration {iteration}: exit checks and checkpoint")
            reason = should_exit(args, iteration, signal_handler, train_start)
            if args.save and (reason or iteration == args.train_iters or
                              (args.save_interval and iteration % args.save_interval == 0)):
                save(args, iteration, model, optimizer, scheduler)
            if reason:
                log_rank_last(f"> exiting after iteration {iteration}: {reason}")
                break
    return losses


def log_iteration(args, iteration, learning_rate, step, optimizer, window) -> None:
    steps = len(window["losses"])
    elapsed = (time.perf_counter() - window["start"]) / steps
    tokens_per_s = args.global_batch_size * args.seq_length / elapsed
    lm_loss = sum(window["losses"]) / steps  # Megatron logs the mean since the last log line
    grad_norm = "" if step.grad_norm is None else f" grad norm: {step.grad_norm:.3f} |"
    log_rank_last(
        f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {iteration:8d}/{args.train_iters:8d} |"
        f" consumed samples: {iteration * args.global_batch_size:12d} |"
        f" elapsed time per iteration (ms): {elapsed * 1000:.1f} |"
        f" throughput (tokens/s): {tokens_per_s:.1f} |"
        f" learning rate: {learning_rate:.6E} |"
        f" global batch size: {args.global_batch_size:5d} |"
        f" lm loss: {lm_loss:.6E} | loss scale: {float(optimizer.get_loss_scale()):.1f} |{grad_norm}"
        f" number of skipped iterations: {window['skipped']:3d} | number of nan iterations: {window['nan']:3d} |")
    window.update(start=time.perf_counter(), losses=[], skipped=0, nan=0)


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    dist.init_process_group(backend, timeout=timeout)
    with distributed_job():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances)
        torch.manual_seed(args.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
        log_rank_last(f"> world size {dist.get_world_size()}: tensor-parallel "
                      f"{args.tensor_model_parallel_size} x data-parallel "
                      f"{parallel_state.get_data_parallel_world_size()} on {parallel_state.get_device_type()}")
        beacon = ProgressBeacon()
        try:
            train(args, beacon)
        except RuntimeError as exc:
            if is_timeout(exc):
                raise CollectiveTimeoutError(beacon.explain_timeout(exc)) from exc
            raise


if __name__ == "__main__":
    sys.exit(main())
