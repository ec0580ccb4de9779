"""pretrain(): Megatron-LM's training entry point, on megatron_fsdp.

    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step)

runs, in order: flags (training/arguments.py) -> process group, model-parallel
groups, seeds, microbatch calculator (training/initialize.py) -> tokenizer ->
model from `model_provider(pre_process, post_process)`, wrapped in
TorchFullyShardedDataParallel (sharded with --use-torch-fsdp2, else
replicated: FSDP2 with a shard size of 1; one mixed-precision policy either
way, training/configs.py) -> optimizer and learning-rate
schedule -> --load -> data iterators -> the training loop -> validation and
test at the end.

One iteration (train_step): the no-pipelining schedule runs the
microbatches (all but the last inside the wrapper's no_sync()),
finalize_model_grads completes the gradient reduction, NaN/inf losses or
gradients stop every rank (--check-for-nan-in-loss-and-grad), the optimizer
steps (an fp16 overflow skips the step), and the schedule advances by the
samples consumed, as in Megatron. After it: the log line, validation every
--eval-interval, a checkpoint every --save-interval, and the exit checks
(--exit-signal-handler, --exit-interval, --exit-duration-in-mins), each of
which saves before stopping every rank at the same iteration.

A bad flag ends the job before start-up (one line on rank 0, exit code 2);
an error after it is one line for the whole job and exit code 1
(training/error_report.py).
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Optional

import torch

from .. import parallel_state
from ..dist_checkpointing.manager import CheckpointManager, get_checkpoint_manager, set_checkpoint_manager
from ..distributed import TorchFullyShardedDataParallel
from ..distributed.finalize_model_grads import finalize_model_grads
from ..enums import ModelType
from ..num_microbatches_calculator import get_num_microbatches, update_num_microbatches
from ..optimizer import get_megatron_optimizer
from ..optimizer_param_scheduler import OptimizerParamScheduler
from ..pipeline_parallel import get_forward_backward_func
from ..tensor_parallel.utils import local_tensor
from ..utils import get_model_config, reject_unsupported
from .arguments import parse_args
from .checkpointing import load_training_checkpoint, save_training_checkpoint
from .data_iterators import build_train_valid_test_data_iterators
from .dist_signal_handler import DistributedSignalHandler
from .error_report import report_errors
from .evaluation import evaluate, evaluate_and_print_results, exit_duration_reached
from .flight_recorder import dump_on_timeout
from .flops import num_floating_point_operations
from .global_vars import get_args, set_tokenizer
from .initialize import check_launched_by_torchrun, distributed_job, initialize_distributed, initialize_megatron
from .nan_check import check_for_nan_in_loss_and_grad
from .profiling import StepProfiler, timed
from .progress import CollectiveTimeoutError, ProgressBeacon, is_timeout
from .training_log import TrainingLogger, build_tensorboard_writer, build_wandb_writer
from .tokenizer import build_tokenizer, vocab_size_with_padding
from .utils import calc_params_l2_norm, print_rank_0, print_rank_last, report_memory

__all__ = ["evaluate", "evaluate_and_print_results", "get_model", "num_floating_point_operations", "pretrain",
           "setup_model_and_optimizer", "setup_tokenizer", "train", "train_step"]


def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults: Optional[dict] = None,
             get_embedding_ranks=None, get_position_embedding_ranks=None, non_loss_data_func=None, store=None):
    """Train a model the Megatron way (see the module docstring). The flags
    are read from the command line; `extra_args_provider` and
    `args_defaults` add flags and change defaults, as in Megatron-LM."""
    reject_unsupported("pretrain", {
        "process_non_loss_data_func": (process_non_loss_data_func, None, "non-loss evaluation data is not supported"),
        "non_loss_data_func": (non_loss_data_func, None, "non-loss evaluation data is not supported"),
        "get_embedding_ranks": (get_embedding_ranks, None, "there is no pipeline parallelism"),
        "get_position_embedding_ranks": (get_position_embedding_ranks, None, "there is no pipeline parallelism"),
    })
    if model_type != ModelType.encoder_or_decoder:
        raise ValueError(f"pretrain: model_type {model_type!r} is not supported (only "
                         "ModelType.encoder_or_decoder)")
    check_launched_by_torchrun(store)
    args = parse_args(extra_args_provider=extra_args_provider, defaults=args_defaults)
    # From here on an error is one line, once for the job, and exit code 1 (see error_report).
    with report_errors():
        initialize_distributed(args, store)
        with distributed_job():
            beacon = ProgressBeacon()
            # Installed before the data loaders start their worker processes, so that a SIGTERM
            # during start-up is also honoured (after the first iteration, as in Megatron).
            handler = DistributedSignalHandler() if args.exit_signal_handler else contextlib.nullcontext()
            try:
                with handler as signal_handler:
                    initialize_megatron(args)
                    _pretrain(args, train_valid_test_dataset_provider, model_provider, model_type,
                              forward_step_func, beacon, signal_handler)
            except RuntimeError as exc:
                if is_timeout(exc):
                    raise CollectiveTimeoutError(beacon.explain_timeout(exc) + dump_on_timeout(args)) from exc
                raise


def setup_tokenizer(args) -> int:
    """Build --tokenizer-type's tokenizer (get_tokenizer() returns it), set
    args.padded_vocab_size, and return the true vocabulary size."""
    tokenizer = build_tokenizer(args)
    vocab_size = tokenizer.vocab_size
    set_tokenizer(tokenizer)
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(vocab_size, args)
    return vocab_size


def _pretrain(args, dataset_provider, model_provider, model_type, forward_step_func, beacon,
              signal_handler: Optional[DistributedSignalHandler] = None) -> None:
    # The run's one owner of its checkpoints: its groups are made here, before any save.
    manager = CheckpointManager(async_save=args.async_save,
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))
    manager.setup()
    previous = set_checkpoint_manager(manager)
    try:
        # Memory history from here (before the model); an out-of-memory error leaves its snapshot.
        with StepProfiler(args) as profiler:
            _pretrain_with(args, dataset_provider, model_provider, model_type, forward_step_func, beacon,
                           signal_handler, manager, profiler)
    except BaseException:
        # Every exit waits for a pending save: here alone (the other ranks may not join a collective).
        _report_saved(manager.wait_locally(timeout=60 * args.distributed_timeout_minutes))
        raise
    finally:
        set_checkpoint_manager(previous)
        manager.close()


def _pretrain_with(args, dataset_provider, model_provider, model_type, forward_step_func, beacon, signal_handler,
                   manager: CheckpointManager, profiler: StepProfiler) -> None:
    train_start = time.time()
    true_vocab_size = setup_tokenizer(args)
    cp = (f"context-parallel {args.context_parallel_size} ({args.cp_comm_type}) x "
          if args.context_parallel_size > 1 else "")
    experts = ""
    if args.num_experts is not None:
        experts = (f"; {args.num_experts} experts: expert-parallel {parallel_state.get_expert_model_parallel_world_size()}"
                   f" x expert-tensor-parallel {parallel_state.get_expert_tensor_parallel_world_size()} x "
                   f"expert-data-parallel {parallel_state.get_expert_data_parallel_world_size()}")
    print_rank_last(f"> world size {args.world_size}: tensor-parallel {args.tensor_model_parallel_size} x {cp}"
                    f"data-parallel {parallel_state.get_data_parallel_world_size()} on "
                    f"{parallel_state.get_device_type()}{experts}")
    beacon.mark("model and optimizer construction")
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type, args=args,
                                                                      true_vocab_size=true_vocab_size, beacon=beacon)
    config = get_model_config(model[0])
    beacon.mark("data loaders")
    train_iterator, valid_iterator, test_iterator = build_train_valid_test_data_iterators(dataset_provider, args)
    logger = TrainingLogger(args, build_tensorboard_writer(args), build_wandb_writer(args))
    try:
        iteration, exit_reason = args.iteration, None
        if args.do_train and not args.skip_train and iteration >= args.train_iters:
            print_rank_0(f"> nothing to train: the checkpoint loaded is at iteration {iteration} and --train-iters "
                         f"is {args.train_iters} (a larger --train-iters trains on)")
        elif args.do_train and not args.skip_train:
            print_rank_0("training ...")
            iteration, flops, exit_reason = train(
                forward_step_func, model, optimizer, opt_param_scheduler, train_iterator, valid_iterator, config,
                args=args, logger=logger, beacon=beacon, train_start=train_start, true_vocab_size=true_vocab_size,
                signal_handler=signal_handler, profiler=profiler)
            saved_last = args.save_interval and iteration % args.save_interval == 0
            if exit_reason is None and args.save and iteration > args.iteration and not saved_last:
                _save(args, iteration, model, optimizer, opt_param_scheduler, flops, true_vocab_size)
        beacon.mark("waiting for the checkpoint being written")
        _report_saved(manager.finalize(blocking=True))  # every way out of training: published before it ends
        if exit_reason is not None:
            return  # as Megatron: an exit condition ends the job without the final evaluation
        beacon.mark("final evaluation")
        if args.do_valid:
            evaluate_and_print_results(f"iteration {iteration} on validation set", forward_step_func,
                                       valid_iterator, model, iteration, config, args, logger=logger,
                                       verbose=True, write_to_tensorboard=not args.skip_train)
        if args.do_test:
            evaluate_and_print_results(f"iteration {iteration} on test set", forward_step_func, test_iterator,
                                       model, iteration, config, args, logger=logger, verbose=True,
                                       write_to_tensorboard=not args.skip_train)
    finally:
        logger.close()


# ---------------------------------------------------------------------- model and optimizer


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp: bool = True, *, args=None):
    """[model]: built by `model_provider_func(pre_process=True, post_process=True)`
    and wrapped in TorchFullyShardedDataParallel: sharded with --use-torch-fsdp2,
    else replicated (args.configs.ddp says which). `wrap_with_ddp=False` returns
    the bare model (converted to fp8 when its config asks)."""
    args = args or get_args()
    model = model_provider_func(pre_process=True, post_process=True)
    count = sum(local_tensor(p).numel() for p in model.parameters())
    if parallel_state.get_data_parallel_rank() == 0:
        print(f" > number of parameters on (tensor, pipeline) model parallel rank "
              f"({parallel_state.get_tensor_model_parallel_rank()}, 0): {count}", flush=True)
    if wrap_with_ddp:
        model = TorchFullyShardedDataParallel(get_model_config(model), args.configs.ddp, model)
        layout = "sharded over" if args.use_torch_fsdp2 else "replicated on"
        print_rank_0(f"> data parallel: FSDP2, parameters {layout} {parallel_state.get_data_parallel_world_size()} "
                     "rank(s)" + ("; sharded parameters, gradients and optimizer state in CPU memory, the "
                                  "optimizer steps there (--optimizer-cpu-offload)" if model.cpu_offload else ""))
        print_rank_0("> FSDP2 copy ops: " + ("megatron_fsdp's kernels" if model.fsdp_copy_kernels_active else
                                            "torch's" + (" (megatron_fsdp's kernels unavailable: warned above)"
                                                         if args.configs.ddp.fsdp_copy_kernels else "")))
        if args.configs.ddp.torch_compile:
            print_rank_0(f"> torch.compile: each of the {args.num_layers} TransformerLayers (the first "
                         "iterations compile)")
    elif getattr(get_model_config(model), "fp8", None) is not None:
        from ..fp8 import convert_to_fp8  # here: a run without fp8 does not load the fp8 stack

        convert_to_fp8(model)  # the wrapper's plan does this when wrapped
    return [model]


def get_optimizer_param_scheduler(optimizer, args=None) -> OptimizerParamScheduler:
    """Megatron's schedule (training/configs.py counts it in samples)."""
    args = args or get_args()
    return OptimizerParamScheduler(optimizer, **args.configs.scheduler)


def _iterations_for_samples(args) -> int:
    """--train-samples as iterations, as Megatron-LM 0.19's update_train_iters: whole global
    batches (a partial last batch is not run; the batch-size ramp-up does not change the count)."""
    return args.train_samples // args.global_batch_size


def setup_model_and_optimizer(model_provider_func, model_type=ModelType.encoder_or_decoder, *, args=None,
                              true_vocab_size: Optional[int] = None, beacon: Optional[ProgressBeacon] = None):
    """(model, optimizer, scheduler), with --load applied: sets args.iteration,
    the consumed samples and args.num_floating_point_operations_so_far."""
    args = args or get_args()
    if args.train_iters is None:
        args.train_iters = _iterations_for_samples(args)
        print_rank_0(f"setting training iterations to {args.train_iters}")
    model = get_model(model_provider_func, model_type, args=args)
    optimizer = get_megatron_optimizer(args.configs.optimizer, model)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer, args)
    args.iteration, args.num_floating_point_operations_so_far = 0, 0.0
    args.consumed_train_samples = args.consumed_valid_samples = 0
    if args.load:
        if beacon is not None:
            beacon.mark("checkpoint load")
        args.iteration, args.num_floating_point_operations_so_far, loaded = load_training_checkpoint(
            args, model, optimizer, opt_param_scheduler, true_vocab_size=true_vocab_size)
        if loaded.get("missing"):
            print_rank_last(f"> WARNING: {loaded['missing']}: training from scratch")
        else:
            print_rank_last(f"> loaded checkpoint from {args.load} at iteration {loaded['iteration']}"
                            + ("" if loaded["rng_restored"] else " (RNG states not restored: other layout)"))
            if loaded.get("padded_vocab_size") and not args.finetune:
                # (a fine-tune starts a run of its own: there is no saved run's loss to continue)
                print_rank_0(padded_vocab_warning(*loaded["padded_vocab_size"], args.tensor_model_parallel_size))
    update_num_microbatches(args.consumed_train_samples, consistency_check=True, verbose=True)
    return model, optimizer, opt_param_scheduler


def padded_vocab_warning(saved_rows: int, rows: int, tp: int) -> str:
    # Megatron's arithmetic: the padding rows' logits (zero-filled weights at first) enter the
    # softmax, so a different padding changes the loss although the real tokens' weights do not.
    keep = (f" (--make-vocab-size-divisible-by {saved_rows // tp} keeps the checkpoint's padding)"
            if saved_rows % tp == 0 else "")
    return (f"> WARNING: the padded vocabulary is {rows} rows, the checkpoint's {saved_rows} (it is padded to a "
            "multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size): the padding logits enter "
            f"the softmax, as in Megatron, so the loss will not continue from the saved run's value{keep}")


# ---------------------------------------------------------------------- the loop


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func, iteration: Optional[int] = None, beacon: Optional[ProgressBeacon] = None):
    """One iteration (`iteration` iterations are done before it). Returns
    (loss dict of 0-dim tensors on the device, skipped_iter, grad_norm, num_zeros_in_grad):
    as in Megatron-LM the losses are read on the host only where they are logged."""
    args = get_args()
    mark = beacon.mark if beacon is not None else (lambda phase: None)
    current = (iteration or 0) + 1
    mark(f"iteration {current}: forward/backward")
    for chunk in model:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
    optimizer.zero_grad()
    num_microbatches = get_num_microbatches()
    reports = forward_backward_func(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        forward_only=False)
    # This rank's own loss: the NaN check names the ranks whose loss is bad.
    local = torch.stack([r[key].detach().float().view(-1)[0] for r in reports for key in r])
    if args.check_for_nan_in_loss_and_grad:
        mark(f"iteration {current}: gradient checks")
        # With fp16 an overflowing gradient is the loss scaler's business: it skips the step.
        grads = None if args.fp16 else [p.grad for chunk in model for p in chunk.parameters() if p.grad is not None]
        check_for_nan_in_loss_and_grad(current, local.sum(), grads)
    mark(f"iteration {current}: optimizer step")
    with timed(config, "optimizer"):
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if update_successful:
        opt_param_scheduler.step(increment=num_microbatches * args.micro_batch_size
                                 * parallel_state.get_data_parallel_world_size())
    mark(f"iteration {current}: loss all-reduce")
    losses = _reduce_losses(reports)
    if getattr(config, "num_moe_experts", None) is not None:
        # The routers' auxiliary losses (Megatron's names, without their coefficients): per MoE layer,
        # summed over the micro-batches x 1 / micro-batches, averaged over the DP ranks.
        from ..transformer.moe.moe_logging import reduce_moe_metrics

        losses.update(reduce_moe_metrics(1.0 / num_microbatches, config.num_layers, config.moe_layer_freq))
    return losses, int(not update_successful), grad_norm, num_zeros_in_grad


def _reduce_losses(reports: list[dict]) -> dict[str, torch.Tensor]:
    """Megatron's reduction of the loss reports: [sum, tokens] pairs summed
    over microbatches and data-parallel ranks, single values averaged over microbatches.
    Device tensors: reading them here would synchronize every step."""
    reduced = {}
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for key in reports[0]:
        values = [r[key].detach().float().view(-1) for r in reports]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0).to(parallel_state.get_device())
            torch.distributed.all_reduce(total, group=group)
            reduced[key] = total[0] / total[1]
        else:
            reduced[key] = torch.cat(values).mean()
    return reduced


def _save(args, iteration, model, optimizer, opt_param_scheduler, flops, true_vocab_size) -> None:
    manager = get_checkpoint_manager()
    started = time.perf_counter()
    previous = manager.finalize(blocking=True)  # a save still being written: published first, and said so
    waited = f" after waiting {time.perf_counter() - started:.2f} s for the previous one" if previous else ""
    _report_saved(previous)
    path = save_training_checkpoint(args, iteration, model, optimizer, opt_param_scheduler, flops, true_vocab_size)
    if manager.pending:
        print_rank_last(f"> checkpoint at iteration {iteration} staged in {manager.pending.blocking_s:.2f} s{waited} "
                        f"({manager.last_staged_bytes / 2**20:.1f} MiB per rank), writing {path} in the background")
    else:
        _report_saved(manager.last_saved)


def _report_saved(saved) -> None:
    """The log line of a published checkpoint (said when it is published, not when it was started)."""
    if saved is not None:
        print_rank_last(f"> {saved.describe()}")


def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration: int, flops: float, *, args,
                               signal_handler, train_start: float, true_vocab_size=None) -> Optional[str]:
    """Save at --save-interval; decide (alike on every rank) whether to stop,
    saving first. Returns why the job stops, or None."""
    saved = False

    def save():
        nonlocal saved
        if args.save and not saved:
            _save(args, iteration, model, optimizer, opt_param_scheduler, flops, true_vocab_size)
            saved = True

    if signal_handler is not None and any(signal_handler.signals_received()):
        save()
        return "a rank received SIGTERM (--exit-signal-handler)"
    if args.save_interval and iteration % args.save_interval == 0:
        save()
    if exit_duration_reached(args, train_start):
        save()
        return f"--exit-duration-in-mins {args.exit_duration_in_mins}"
    if args.exit_interval and iteration % args.exit_interval == 0:
        save()
        return f"--exit-interval {args.exit_interval}"
    return None


def train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, valid_data_iterator,
          config, *, args, logger: TrainingLogger, beacon: ProgressBeacon, train_start: float,
          true_vocab_size: Optional[int] = None, signal_handler: Optional[DistributedSignalHandler] = None,
          profiler: Optional[StepProfiler] = None):
    """The training loop from args.iteration to args.train_iters. Returns
    (iteration, FLOPs so far, why it stopped early or None). With
    --exit-signal-handler, `signal_handler` is pretrain()'s (installed before
    the data loaders started); without one the loop installs its own. So
    with `profiler` (the --profile flags, training/profiling.py)."""
    for chunk in model:
        chunk.train()
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model[0].no_sync if hasattr(model[0], "no_sync") else None
    forward_backward_func = get_forward_backward_func()
    iteration = start_iteration = args.iteration
    flops = args.num_floating_point_operations_so_far
    num_microbatches = get_num_microbatches()
    dp = parallel_state.get_data_parallel_world_size()
    exit_reason = None
    if signal_handler is not None or not args.exit_signal_handler:
        handler = contextlib.nullcontext(signal_handler)
    else:
        handler = DistributedSignalHandler()
    # pretrain()'s profiler, or one of the loop's own (closed with it).
    profiling = StepProfiler(args) if profiler is None else contextlib.nullcontext(profiler)
    with handler as signal_handler, profiling as profiler:
        profiler.begin(config, iteration)
        while iteration < args.train_iters:
            profiler.step_begin(iteration + 1)
            update_num_microbatches(args.consumed_train_samples, consistency_check=False, verbose=True)
            if get_num_microbatches() != num_microbatches and iteration != 0 and args.save:
                # As Megatron: a checkpoint at every batch-size change of a ramp-up.
                paused = logger.pause()
                _save(args, iteration, model, optimizer, opt_param_scheduler, flops, true_vocab_size)
                logger.resume(paused)
            num_microbatches = get_num_microbatches()
            update_num_microbatches(args.consumed_train_samples, consistency_check=True, verbose=True)

            loss_dict, skipped_iter, grad_norm, num_zeros = train_step(
                forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config,
                forward_backward_func, iteration=iteration, beacon=beacon)
            iteration += 1
            batch_size = dp * args.micro_batch_size * num_microbatches
            args.consumed_train_samples += batch_size
            flops += num_floating_point_operations(args, batch_size)
            beacon.mark(f"iteration {iteration}: logging, evaluation, checkpoint and exit checks")
            logger.training_log(loss_dict, optimizer.param_groups[0]["lr"], iteration,
                                optimizer.get_loss_scale(), skipped_iter, grad_norm,
                                calc_params_l2_norm(model) if args.log_params_norm else None, num_zeros, batch_size)
            if iteration == start_iteration + 1:
                report_memory(f"(after {iteration} iterations)")
            if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
                paused = logger.pause()
                evaluate_and_print_results(f"iteration {iteration}", forward_step_func, valid_data_iterator, model,
                                           iteration, config, args, logger=logger, train_start=train_start)
                logger.resume(paused)
            paused = logger.pause()  # as Megatron: checkpoint time is not training time
            exit_reason = checkpoint_and_decide_exit(
                model, optimizer, opt_param_scheduler, iteration, flops, args=args, signal_handler=signal_handler,
                train_start=train_start, true_vocab_size=true_vocab_size)
            _report_saved(get_checkpoint_manager().finalize(blocking=False))  # a background save done?
            logger.resume(paused)
            profiler.step_end(iteration)
            if exit_reason:
                print_rank_last(f"> exiting after iteration {iteration}: {exit_reason}")
                break
        profiler.end()  # a window the run ended in is written now, without the final evaluation
    return iteration, flops, exit_reason
