"""What the torchrun GPT benchmarks share: the model flags, the process and
model-parallel setup, and arms timed in alternating rounds.

A benchmark compares arms (models, or settings of one model) in one run.
Steps alternate between the arms in rounds, so machine noise hits every arm
alike; each arm's step time is the median over its rounds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.training.initialize import distributed_job, gpu_shortage
from megatron_fsdp.transformer import TransformerConfig


def add_gpt_arguments(parser: argparse.ArgumentParser, *, steps_per_round: int) -> None:
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-round", type=int, default=steps_per_round)
    parser.add_argument("--seed", type=int, default=1234)


@contextmanager
def gpt_benchmark_job(args) -> Iterator[TransformerConfig]:
    """One process of a torchrun job: NCCL on a GPU, else gloo with the
    machine's cores split between the local ranks; parallel_state at
    `--tp`; yields the GPT config the flags describe."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    with distributed_job():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
        yield TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                tensor_model_parallel_size=args.tp, hidden_dropout=0.0, attention_dropout=0.0,
                                sequence_parallel=args.tp > 1)


def build_gpt(args, config: TransformerConfig) -> GPTModel:
    """The same weights on every call (seeded as Megatron seeds a build)."""
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    return GPTModel(config, vocab_size=args.vocab, max_sequence_length=args.seq)


def require_our_kernels_on(device: torch.device) -> None:
    """Stop a kernel benchmark that would time something else: on CUDA without a
    GPU, or with an extension built without CUDA ("ours" would silently be torch's
    ops), or with no extension at all."""
    from megatron_fsdp import kernels

    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if device.type == "cuda" and not kernels.extension_has_cuda():
        raise SystemExit(f"--device cuda: the extension is not built with CUDA ({kernels.extension_import_error()})")
    if not kernels.extension_available():
        raise SystemExit(f"the extension is not built: {kernels.extension_import_error()}")


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads/rank)"


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t` (its shard, for a DTensor)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def time_arms_in_rounds(step: Callable[[str], None], arms, rounds: int, steps_per_round: int, *,
                        before_round: Optional[Callable[[str], None]] = None,
                        after_round: Optional[Callable[[str], None]] = None) -> dict[str, float]:
    """Median milliseconds per `step(arm)` for each arm. One warm-up step per
    arm first (so optimizer state exists). `before_round(arm)` runs, untimed,
    before the arm's warm-up step and each of its timed rounds;
    `after_round(arm)` after each timed round."""
    for arm in arms:
        if before_round is not None:
            before_round(arm)
        step(arm)
    times = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            if before_round is not None:
                before_round(arm)
            _synchronize()
            start = time.perf_counter()
            for _ in range(steps_per_round):
                step(arm)
            _synchronize()
            times[arm].append((time.perf_counter() - start) / steps_per_round)
            if after_round is not None:
                after_round(arm)
    return {arm: 1000 * statistics.median(t) for arm, t in times.items()}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def dense_bf16_tflops(device: torch.device, n: int) -> float:
    """The bf16 matmul rate this device reaches on n x n operands."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    reps = 20 if device.type == "cuda" else 3
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - start) / 1e12


def single_process_defaults() -> None:
    """Let `python <benchmark>.py` run as a world of one, as torchrun would start it."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def best_of_rounds(arms: dict, repeats: int, device: torch.device) -> dict:
    """Milliseconds of each arm's best round: one warm-up call each (compilation, caches),
    then `repeats` rounds in which every arm runs once, alternating (noise hits all alike)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in arms.values():  # warm-up
        fn()
    sync()
    best = {name: float("inf") for name in arms}
    for _ in range(repeats):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: t * 1000 for name, t in best.items()}


def api_step(model, optimizer, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One training step of our API: a GPTModel in TorchFullyShardedDataParallel and
    get_megatron_optimizer's optimizer; returns the loss (not read back)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(ids, positions, None, labels=ids).float().mean()
    loss.backward()
    model.finish_grad_sync()
    optimizer.step()
    return loss


def start_process_group(error: Callable[[str], BaseException]) -> bool:
    """A torchrun job's process group: NCCL with one GPU per process, or gloo with the cores split
    between the processes; raises `error(message)` where the GPUs are too few. True on CUDA."""
    cuda = torch.cuda.is_available()
    local_world, local_rank = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    shortage = gpu_shortage("nccl" if cuda else "gloo", local_world, local_rank)
    if shortage:
        raise error(shortage)
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("nccl" if cuda else "gloo")
    return cuda
