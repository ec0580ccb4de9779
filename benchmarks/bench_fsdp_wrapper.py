"""TorchFullyShardedDataParallel against raw `fully_shard` applied by hand, in one run.

    torchrun --nproc-per-node 4 benchmarks/bench_fsdp_wrapper.py [--tp 1] [--rounds 5]
    torchrun --nproc-per-node 4 benchmarks/bench_fsdp_wrapper.py --compare copy-kernels --layers 16 --hidden 64

With `--compare copy-kernels` the two arms are the wrapper with megatron_fsdp's
copy kernels and with torch's copy ops (switched before each arm's round; the
switch is process-wide).

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

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from _common import add_gpt_arguments, build_gpt, device_name, gpt_benchmark_job, local_bytes, time_arms_in_rounds
from megatron_fsdp import parallel_state
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.kernels import fsdp_copy_ops
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.transformer import TransformerLayer


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
    add_gpt_arguments(p, steps_per_round=5)
    p.add_argument("--compare", choices=["raw-fully-shard", "copy-kernels"], default="raw-fully-shard")
    args = p.parse_args()

    with gpt_benchmark_job(args) as config:
        device = parallel_state.get_device()
        # As pretrain() runs it: with our copy kernels (process-wide, so the raw arm runs them too
        # unless --compare copy-kernels switches them per arm).
        wrapped = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(fsdp_copy_kernels=True),
                                                build_gpt(args, config))
        if args.compare == "raw-fully-shard":
            baseline_name, baseline = "raw_fully_shard", shard_by_hand(build_gpt(args, config))
        else:
            baseline_name = "torch_copy_ops"
            baseline = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(),
                                                     build_gpt(args, config))
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

        def step(name):
            model, optimizer = arms[name]
            loss = model(ids, positions, None, labels=ids).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        step_ms = time_arms_in_rounds(step, arms, args.rounds, args.steps_per_round, before_round=select_copy_ops)
        result = {
            "world_size": dist.get_world_size(), "tp": args.tp,
            "dp": parallel_state.get_data_parallel_world_size(),
            "device": device_name(),
            "step_ms": step_ms,
            "memory_per_rank": {name: memory(*arms[name]) for name in arms},
        }
        result["wrapper_over_baseline"] = step_ms["wrapper"] / step_ms[baseline_name]
        if torch.cuda.is_available():
            result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
