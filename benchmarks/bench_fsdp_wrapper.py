"""TorchFullyShardedDataParallel against raw `fully_shard` applied by hand, in one run.

    torchrun --nproc-per-node 4 benchmarks/bench_fsdp_wrapper.py [--tp 1] [--rounds 5]
    torchrun --nproc-per-node 4 benchmarks/bench_fsdp_wrapper.py --compare copy-kernels --layers 16 --hidden 64

With `--compare copy-kernels` the two arms are the wrapper with megatron_fsdp's
copy kernels and with torch's copy ops (toggled before each arm's round; the
op registry is process-wide).

Both arms shard the same GPT model (same seed, same units: each
TransformerLayer, the embedding, the output layer, then the root) over the
same mesh, and train with the same AdamW. Steps alternate between the arms in
rounds, so machine noise hits both alike; the reported overhead is the ratio
of median step times. Memory is what each rank holds for parameters,
gradients and optimizer state (exact bytes of its local shards), plus the CUDA
peak when on a GPU. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.kernels import fsdp_copy_ops
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.training.initialize import distributed_job
from megatron_fsdp.transformer import TransformerConfig, TransformerLayer


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def build(args, config):
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    return GPTModel(config, vocab_size=args.vocab, max_sequence_length=args.seq)


def shard_by_hand(model: GPTModel) -> GPTModel:
    mesh = parallel_state.get_data_parallel_mesh(with_context_parallel=True)
    for layer in model.decoder.layers:
        assert isinstance(layer, TransformerLayer)
        fully_shard(layer, mesh=mesh)
    fully_shard(model.embedding, mesh=mesh)
    fully_shard(model.output_layer, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    if dist.get_backend() == "gloo":
        model.set_force_sum_reduction_for_comms(True)
    return model


def memory(model, optimizer) -> dict:
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": states,
            "total_bytes": params + grads + states}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compare", choices=["raw-fully-shard", "copy-kernels"], default="raw-fully-shard")
    args = p.parse_args()

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

        wrapped = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), build(args, config))
        if args.compare == "raw-fully-shard":
            baseline_name, baseline = "raw_fully_shard", shard_by_hand(build(args, config))
        else:
            baseline_name = "torch_copy_ops"
            baseline = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), build(args, config))
        arms = {}
        for name, model in (("wrapper", wrapped), (baseline_name, baseline)):
            arms[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def select_copy_ops(name):
            if args.compare == "copy-kernels":
                if name == "wrapper":
                    fsdp_copy_ops.enable_fsdp_copy_kernels()
                else:
                    fsdp_copy_ops.disable_fsdp_copy_kernels()

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=g).to(device)
        positions = torch.arange(args.seq, device=device).expand(args.micro_batch, -1)

        def step(model, optimizer):
            loss = model(ids, positions, None, labels=ids).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        def timed(name):
            select_copy_ops(name)
            model, optimizer = arms[name]
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps_per_round):
                step(model, optimizer)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            return (time.perf_counter() - start) / args.steps_per_round

        for name in arms:  # warm-up, and optimizer state exists for the memory count
            select_copy_ops(name)
            step(*arms[name])
        times = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name in arms:
                times[name].append(timed(name))
        result = {
            "world_size": dist.get_world_size(), "tp": args.tp,
            "dp": parallel_state.get_data_parallel_world_size(),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "step_ms": {name: 1000 * statistics.median(t) for name, t in times.items()},
            "memory_per_rank": {name: memory(*arms[name]) for name in arms},
        }
        result["wrapper_over_baseline"] = result["step_ms"]["wrapper"] / result["step_ms"][baseline_name]
        if cuda:
            result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
