"""Gradient accumulation: sharded (the default) against unsharded (opt-in), in one run.

    torchrun --nproc-per-node 4 benchmarks/bench_grad_accumulation.py [--tp 1] [--microbatches 4] [--rounds 5]

The two arms wrap the same GPT model (same seed) with
TorchFullyShardedDataParallel; they differ only in
`accumulate_unsharded_grads_in_no_sync`. A step is Megatron's schedule: every
microbatch but the last inside no_sync(), then finish_grad_sync() and AdamW.
Steps alternate between the arms in rounds, so machine noise hits both alike;
the step time is the median over rounds (benchmarks/_common.py).

Memory per rank: the gradient bytes held between microbatches (this rank's
sharded `.grad` plus any unsharded gradient FSDP2 keeps for a later
reduce-scatter), counted exactly from the tensors, at its peak over the
step; on a GPU also torch.cuda.max_memory_allocated over each arm's steps.
Rank 0 prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import torch
import torch.distributed as dist

from _common import add_gpt_arguments, build_gpt, device_name, gpt_benchmark_job, local_bytes, time_arms_in_rounds
from megatron_fsdp import parallel_state
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig

ARMS = {"sharded (default)": False, "unsharded (opt-in)": True}


def main():
    p = argparse.ArgumentParser()
    add_gpt_arguments(p, steps_per_round=2)
    p.add_argument("--microbatches", type=int, default=4)
    args = p.parse_args()
    if args.microbatches < 1:
        raise ValueError(f"--microbatches must be at least 1, got {args.microbatches}")
    cuda = torch.cuda.is_available()

    with gpt_benchmark_job(args) as config:
        device = parallel_state.get_device()
        arms = {}
        for name, unsharded in ARMS.items():
            ddp_config = TorchFullyShardedDataParallelConfig(accumulate_unsharded_grads_in_no_sync=unsharded,
                                                             fsdp_copy_kernels=True)  # as pretrain() runs it
            wrapped = TorchFullyShardedDataParallel(config, ddp_config, build_gpt(args, config))
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
                held = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
                peak_grad_bytes[name] = max(peak_grad_bytes[name], held + model.unsharded_grad_bytes())
            model.finish_grad_sync()
            optimizer.step()

        cuda_peak = {}

        def reset_cuda_peak(name):
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def record_cuda_peak(name):
            if cuda:
                cuda_peak[name] = max(cuda_peak.get(name, 0), torch.cuda.max_memory_allocated())

        step_ms = time_arms_in_rounds(step, arms, args.rounds, args.steps_per_round,
                                      before_round=reset_cuda_peak, after_round=record_cuda_peak)

        # Every rank's figure is measured; the table shows the largest.
        measured = torch.tensor([peak_grad_bytes[n] for n in arms] + [cuda_peak.get(n, 0) for n in arms],
                                dtype=torch.float64, device=device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        peaks = dict(zip(arms, measured[:len(arms)].tolist()))
        cuda_peaks = dict(zip(arms, measured[len(arms):].tolist()))
        result = {
            "world_size": dist.get_world_size(), "tp": args.tp, "dp": parallel_state.get_data_parallel_world_size(),
            "microbatches": args.microbatches, "parameters": parameters, "device": device_name(),
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
