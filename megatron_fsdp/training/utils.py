"""Small helpers of Megatron-LM's training scripts (`megatron.training.utils` names)."""

from __future__ import annotations

import os
import resource
import sys

import torch
import torch.distributed as dist

from .. import parallel_state
from ..utils import is_distributed
from ..utils import unwrap_model  # noqa: F401  (Megatron-LM keeps it in megatron.training.utils too)


def is_last_rank() -> bool:
    return not is_distributed() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(message: str) -> None:
    if not is_distributed() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    """Megatron prints its training log from the last rank."""
    if is_last_rank():
        print(message, flush=True)


def memory_report(name: str) -> str:
    """Megatron's `report_memory` line: CUDA allocator figures on a GPU; on
    the CPU the process's peak resident set size."""
    mega = 1024.0 * 1024.0
    rank = dist.get_rank() if is_distributed() else 0
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_device_type() == "cuda":
        return (f"[Rank {rank}] {name} memory (MB) | allocated: {torch.cuda.memory_allocated() / mega} | "
                f"max allocated: {torch.cuda.max_memory_allocated() / mega} | "
                f"reserved: {torch.cuda.memory_reserved() / mega} | "
                f"max reserved: {torch.cuda.max_memory_reserved() / mega}")
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return f"[Rank {rank}] {name} memory (MB) | max resident (CPU): {peak / mega:.1f}"


def report_memory(name: str) -> None:
    """Print memory_report once per model-parallel rank (on data-parallel rank 0)."""
    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_data_parallel_rank() == 0:
        print(memory_report(name), flush=True)


@torch.no_grad()
def calc_params_l2_norm(model) -> float:
    """L2 norm of all parameters (Megatron's --log-params-norm), each element
    counted once however the parameter is sharded or replicated across ranks."""
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size() if is_distributed() else 1
    total = torch.zeros((), dtype=torch.float64,
                        device=parallel_state.get_device() if parallel_state.model_parallel_is_initialized() else None)
    for chunk in model if isinstance(model, list) else [model]:
        for p in chunk.parameters():
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                copies = world // mesh.size()  # ranks outside the mesh hold their own copy
                for dim, placement in enumerate(p.placements):
                    if placement.is_replicate():
                        copies *= mesh.size(dim)
                local = p.to_local()
            else:
                copies, local = world, p
            total += local.detach().double().square().sum().to(total.device) / copies
    if is_distributed():
        dist.all_reduce(total)
    return float(total.sqrt())


def write_whole(path: str, write) -> str:
    """`write(temporary path)`, then the rename: a reader never sees a half-written file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path
