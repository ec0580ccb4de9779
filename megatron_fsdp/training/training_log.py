"""The training log: Megatron-LM's log line, TensorBoard and Weights & Biases scalars.

The log line (printed by the last rank every --log-interval iterations):

     [2025-01-01 12:00:00.000000] iteration       20/     100 | consumed samples:          320 |
     elapsed time per iteration (ms): 212.4 | throughput per GPU (TFLOP/s/GPU): 1.2 |
     throughput per GPU (tokens/s/GPU): 602.6 | learning rate: 2.955447E-03 | global batch size:    16 |
     lm loss: 2.113416E+00 | loss scale: 1.0 | grad norm: 0.412 | number of skipped iterations:   0 |
     number of nan iterations:   0 |

(one line). Elapsed time, TFLOP/s and the losses are means over the
iterations since the previous line (losses over the iterations whose step
was not skipped, as in Megatron). The two throughput fields appear with
--log-throughput; TFLOP/s uses megatron_fsdp.training.flops and counts all
ranks (TP x DP) as GPUs. Below 1 it is printed with three significant
digits instead of Megatron's one decimal, which would print 0.0 on a CPU.
An iteration counts as a NaN iteration when its loss or gradient norm is
not finite.

TensorBoard (--tensorboard-dir, on the last rank) and wandb (--wandb-project)
get Megatron's scalar names: learning-rate, batch-size, each loss, loss-scale,
grad-norm, num-zeros, params-norm (each also "<name> vs samples"),
world-size, iteration-time and throughput (--log-timers-to-tensorboard),
mem-* (--log-memory-to-tensorboard, CUDA), and "<loss> validation" (+ ppl).
"""

from __future__ import annotations

import math
import os
import time
from datetime import datetime
from typing import Optional

import torch

from .flops import num_floating_point_operations
from .utils import is_last_rank, print_rank_last


def format_throughput(value: float) -> str:
    """Megatron's {:.1f}, or three significant digits for values below 1."""
    if value >= 1 or value <= 0 or not math.isfinite(value):
        return f"{value:.1f}"
    return f"{value:.{max(1, 2 - math.floor(math.log10(value)))}f}"


def build_tensorboard_writer(args):
    """A SummaryWriter on the last rank when --tensorboard-dir is given, else None."""
    if args.tensorboard_dir is None or not is_last_rank():
        return None
    from torch.utils.tensorboard import SummaryWriter  # needs tensorboard: checked in arguments
    return SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)


def build_wandb_writer(args):
    """A wandb run on the last rank when --wandb-project is given, else None."""
    if args.wandb_project is None or not is_last_rank():
        return None
    import wandb  # checked in arguments
    save_dir = args.wandb_save_dir or (os.path.join(args.save, "wandb") if args.save else None)
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    wandb.init(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project,
               config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))})
    return wandb


def _host(value) -> float:
    """A logged value on the host: a device tensor is read (a synchronization) only here."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class TrainingLogger:
    """Accumulates iterations between log lines and writes the line and the scalars.

    Losses and the loss scale may be device tensors: they are summed (and checked for
    NaN) on the device and read only at --log-interval and --tensorboard-log-interval
    iterations, so a step between them costs no synchronization here (Megatron-LM's
    training_log reads them at the same intervals)."""

    def __init__(self, args, tensorboard_writer=None, wandb_writer=None, clock=time.perf_counter):
        self.args = args
        self.clock = clock
        self.writer = tensorboard_writer
        self.wandb = wandb_writer
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_start = self.clock()
        self.loss_sums: dict = {}  # key -> float or device tensor
        self.advanced = self.skipped = self.nan = 0
        self.nan_on_device = None  # iterations whose device losses were not finite, counted there

    def pause(self) -> float:
        """Evaluation time does not count as training time: returns the pause start."""
        return self.clock()

    def resume(self, paused_at: float) -> None:
        self.window_start += self.clock() - paused_at

    def _scalar(self, name: str, value: float, iteration: int, samples: Optional[int] = None) -> None:
        if self.writer is not None:
            self.writer.add_scalar(name, value, iteration)
            if samples is not None:
                self.writer.add_scalar(f"{name} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log({name: value}, iteration)

    def training_log(self, loss_dict: dict, learning_rate: float, iteration: int, loss_scale,
                     skipped_iter: int, grad_norm: Optional[float], params_norm: Optional[float],
                     num_zeros_in_grad: Optional[int], batch_size: int) -> None:
        """Record one finished iteration; print and write at the intervals."""
        args = self.args
        samples = args.consumed_train_samples
        on_host = [v for v in loss_dict.values() if not isinstance(v, torch.Tensor)]
        on_host += [grad_norm] if grad_norm is not None else []
        on_device = [v.detach().float().reshape(()) for v in loss_dict.values() if isinstance(v, torch.Tensor)]
        if not all(math.isfinite(v) for v in on_host):
            self.nan += 1
        elif on_device:
            bad = (~torch.isfinite(torch.stack(on_device))).any().int()
            self.nan_on_device = bad if self.nan_on_device is None else self.nan_on_device + bad
        if skipped_iter:
            self.skipped += 1
        else:
            self.advanced += 1
            for key, value in loss_dict.items():
                self.loss_sums[key] = self.loss_sums.get(key, 0.0) + value

        if (self.writer is not None or self.wandb is not None) and iteration % args.tensorboard_log_interval == 0:
            self._scalar("learning-rate", learning_rate, iteration, samples)
            self._scalar("batch-size", batch_size, iteration, samples)
            for key, value in loss_dict.items():
                self._scalar(key, _host(value), iteration, samples)
            if args.log_loss_scale_to_tensorboard:
                self._scalar("loss-scale", _host(loss_scale), iteration, samples)
            if args.log_world_size_to_tensorboard:
                self._scalar("world-size", args.world_size, iteration, samples)
            for name, value in (("grad-norm", grad_norm), ("num-zeros", num_zeros_in_grad),
                                ("params-norm", params_norm)):
                if value is not None:
                    self._scalar(name, value, iteration, samples)
            if args.log_memory_to_tensorboard and torch.cuda.is_available():
                stats = torch.cuda.memory_stats()
                self._scalar("mem-reserved-bytes", stats["reserved_bytes.all.current"], iteration)
                self._scalar("mem-allocated-bytes", stats["allocated_bytes.all.current"], iteration)
                self._scalar("mem-max-allocated-bytes", stats["allocated_bytes.all.peak"], iteration)
                self._scalar("mem-allocated-count", stats["allocation.all.current"], iteration)

        if iteration % args.log_interval != 0:
            return
        iterations = self.advanced + self.skipped
        per_iteration = (self.clock() - self.window_start) / iterations
        world = args.world_size
        tflops = num_floating_point_operations(args, batch_size) / (per_iteration * 10 ** 12 * world)
        tokens = batch_size * args.seq_length / (per_iteration * world)
        if args.log_timers_to_tensorboard:
            self._scalar("iteration-time", per_iteration, iteration)
            if args.log_throughput:
                self._scalar("throughput", tflops, iteration)
        line = (f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
                f" iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {samples:12d} |"
                f" elapsed time per iteration (ms): {per_iteration * 1000.0:.1f} |")
        if args.log_throughput:
            line += (f" throughput per GPU (TFLOP/s/GPU): {format_throughput(tflops)} |"
                     f" throughput per GPU (tokens/s/GPU): {tokens:.1f} |")
        line += f" learning rate: {learning_rate:.6E} | global batch size: {batch_size:5d} |"
        for key, total in self.loss_sums.items():
            line += f" {key}: {_host(total) / max(1, self.advanced):.6E} |"
        line += f" loss scale: {_host(loss_scale):.1f} |"
        if grad_norm is not None:
            line += f" grad norm: {grad_norm:.3f} |"
        if num_zeros_in_grad is not None:
            line += f" num zeros: {num_zeros_in_grad} |"
        if params_norm is not None:
            line += f" params norm: {params_norm:.3f} |"
        nan = self.nan + (int(self.nan_on_device.item()) if self.nan_on_device is not None else 0)
        line += (f" number of skipped iterations: {self.skipped:3d} |"
                 f" number of nan iterations: {nan:3d} |")
        print_rank_last(line)
        self._reset_window()

    def validation(self, key: str, value: float, iteration: int, suffix: str = "") -> None:
        name = f"{key} validation{suffix}"
        self._scalar(name, value, iteration, self.args.consumed_train_samples)
        if self.args.log_validation_ppl_to_tensorboard:
            self._scalar(f"{name} ppl", math.exp(min(20.0, value)), iteration, self.args.consumed_train_samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
