"""Gradient accumulation: sharded (the default) against unsharded (opt-in), in one run.

    torchrun --nproc-per-node 4 benchmarks/bench_grad_accumulation.py [--tp 1] [--microbatches 4] [--rounds 5]

The two arms wrap the same GPT model (same seed) with
TorchFullyShardedDataParallel; they differ only in
`accumulate_unsharded_grads_in_no_sync`. A step is Megatron's schedule: every
microbatch but the last inside no_sync(), then finish_grad_sync() and AdamW.
Steps alternate between the arms in rounds, so machine noise hits both alike;
the step time is the median over rounds.

Memory per rank: the gradient bytes held between microbatches (this rank's
sharded `.grad` plus any unsharded gradient FSDP2 keeps for a later
reduce-scatter), counted exactly from the tensors, at its peak over the
step; on a GPU also torch.cuda.max_memory_allocated over each arm's steps.
Rank 0 prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.training.initialize import distributed_job
from megatron_fsdp.transformer import TransformerConfig

ARMS = {"sharded (default)": False, "unsharded (opt-in)": True}


def sharded_grad_bytes(model) -> int:
    held = 0
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            held += g.numel() * g.element_size()
    return held


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    if args.microbatches < 1:
        raise ValueError(f"--microbatches must be at least 1, got {args.microbatches}")

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("nccl" if cuda else "gloo")
    with distributed_job():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
        device = parallel_state.get_device()
        config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                   tensor_model_parallel_size=args.tp, hidden_dropout=0.0, attention_dropout=0.0,
                                   sequence_parallel=args.tp > 1)
        arms = {}
        for name, unsharded in ARMS.items():
            tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
            model = GPTModel(config, vocab_size=args.vocab, max_sequence_length=args.seq)
            ddp_config = TorchFullyShardedDataParallelConfig(accumulate_unsharded_grads_in_no_sync=unsharded)
            wrapped = TorchFullyShardedDataParallel(config, ddp_config, model)
            arms[name] = (wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4))
        parameters = sum(p.numel() for p in next(iter(arms.values()))[0].parameters())

        g = torch.Generator().manual_seed(dist.get_rank() // args.tp)
        ids = torch.randint(0, args.vocab, (args.microbatches, args.micro_batch, args.seq), generator=g).to(device)
        positions = torch.arange(args.seq, device=device).expand(args.micro_batch, -1)
        peak_grad_bytes = {name: 0 for name in arms}

        def step(name):
            model, optimizer = arms[name]
            model.zero_grad_buffer()
            for i in range(args.microbatches):
                last = i == args.microbatches - 1
                with nullcontext() if last else model.no_sync():
                    (model(ids[i], positions, None, labels=ids[i]).mean() / args.microbatches).backward()
                held = sharded_grad_bytes(model) + model.unsharded_grad_bytes()
                peak_grad_bytes[name] = max(peak_grad_bytes[name], held)
            model.finish_grad_sync()
            optimizer.step()

        def timed(name):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps_per_round):
                step(name)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            return (time.perf_counter() - start) / args.steps_per_round

        cuda_peak = {}
        for name in arms:  # warm-up; optimizer state exists before the peaks are taken
            step(name)
        times = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name in arms:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                times[name].append(timed(name))
                if cuda:
                    cuda_peak[name] = max(cuda_peak.get(name, 0), torch.cuda.max_memory_allocated())

        # Every rank's figure is measured; the table shows the largest.
        measured = torch.tensor([peak_grad_bytes[n] for n in arms] + [cuda_peak.get(n, 0) for n in arms],
                                dtype=torch.float64, device=device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        peaks = dict(zip(arms, measured[:len(arms)].tolist()))
        cuda_peaks = dict(zip(arms, measured[len(arms):].tolist()))
        step_ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
        result = {
            "world_size": dist.get_world_size(), "tp": args.tp, "dp": parallel_state.get_data_parallel_world_size(),
            "microbatches": args.microbatches, "parameters": parameters,
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads/rank)",
            "step_ms": step_ms, "peak_grad_bytes_per_rank": peaks,
        }
        if cuda:
            result["cuda_peak_bytes_per_rank"] = cuda_peaks
        if dist.get_rank() == 0:
            print(f"TP{args.tp} x DP{result['dp']}, {args.microbatches} microbatches, "
                  f"{parameters / 1e6:.2f}M parameters, {result['device']}")
            header = f"{'mode':<20} {'step ms':>9} {'grad MiB/rank':>14}" + (f" {'CUDA peak MiB':>14}" if cuda else "")
            print(header)
            for name in arms:
                row = f"{name:<20} {step_ms[name]:>9.1f} {peaks[name] / 2**20:>14.2f}"
                print(row + (f" {cuda_peaks[name] / 2**20:>14.1f}" if cuda else ""))
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
