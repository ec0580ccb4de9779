"""The routed experts: GroupedMLP and SequentialMLP, with the same parameters.

Both hold every expert's weights in two tensors whose full shapes do not depend on the
parallel layout (so checkpoints do not depend on moe_grouped_gemm, EP or expert TP):
`linear_fc1.weight` [E, G, F, H] (G = 2 with gated_linear_unit: index 0 the gate, 1 the up
projection; else G = 1) and `linear_fc2.weight` [E, H, F], F = moe_ffn_hidden_size. With
EP x expert TP > 1 they are DTensors on parallel_state.get_expert_model_parallel_mesh()
("ep", "etp"), Shard(0) over EP (the experts) and Shard(2) over expert TP (F); else plain
tensors. Initial values are drawn as the full tensors (config.init_method for fc1,
output_layer_init_method for fc2), each rank keeping its part: the same full weights at any
EP / expert-TP size. Every expert parameter is marked `allreduce = False` (Megatron's marker);
the modules have `is_expert = True` (the FSDP plan's marker).

The experts weigh their outputs by the routing weights (on the activation, before fc2, as
Megatron does). Under expert TP each rank computes its part of F, and fc2's partial sums are
added by the dispatcher's reduce-scatter.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ... import _torch_compat, parallel_state
from ...tensor_parallel.reset import ResetsDeclaredParameters
from ...tensor_parallel.utils import (init_full_tensor, local_tensor, record_init,
                                      set_tensor_model_parallel_attributes)
from ...utils import reject_unsupported
from ..fused_activations import weighted_swiglu


def make_expert_parameter(full: torch.Tensor, config) -> nn.Parameter:
    """This rank's part of the full expert tensor `full` ([E, ..., F-dim at 2, ...]): experts
    (dim 0) over EP, dim 2 over expert TP; a DTensor on the (ep, etp) mesh when that has more
    than one rank."""
    mesh = parallel_state.get_expert_model_parallel_mesh()
    ep, etp = mesh.size(0), mesh.size(1)
    if full.size(0) % ep or full.size(2) % etp:
        raise ValueError(f"expert tensor of shape {tuple(full.shape)}: dimension 0 must be divisible by the "
                         f"expert-model-parallel size {ep} and dimension 2 by the expert-tensor-parallel size {etp}")
    local = full.chunk(ep, dim=0)[mesh.get_local_rank("ep")].chunk(etp, dim=2)[mesh.get_local_rank("etp")]
    device = full.device if full.device.type == "meta" else parallel_state.get_device()
    # copy=True: a view would keep the whole `full` tensor alive.
    local = local.to(device=device, dtype=config.params_dtype, copy=True, memory_format=torch.contiguous_format)
    if ep * etp == 1:
        param = nn.Parameter(local)
    else:
        param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0), Shard(2)], run_check=False,
                                                shape=full.shape, stride=full.stride()))
    set_tensor_model_parallel_attributes(param, True, 2, 1)
    param.allreduce = False  # NOTE: Megatron's marker of an expert parameter (reduced over expert DP)
    return param


class ExpertWeight(ResetsDeclaredParameters, nn.Module):
    """One expert weight tensor (see the module docstring), as `<name>.weight`."""

    def __init__(self, shape: tuple[int, ...], init_method: Callable, config):
        super().__init__()
        self.full_shape = tuple(shape)
        self.weight = make_expert_parameter(init_full_tensor(self.full_shape, init_method, config), config)
        record_init(self, "weight", init_method, config)

    def extra_repr(self) -> str:
        return f"full_shape={self.full_shape}"


class _ExpertsBase(nn.Module):
    """The experts' parameters and their per-token computation; subclasses choose the GEMMs.
    forward(tokens [n, H] grouped by local expert, tokens_per_expert [local experts] (host),
    probs [n]) -> (output [n, H], None)."""

    is_expert = True

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: Optional[str] = None):
        super().__init__()
        where = type(self).__name__
        reject_unsupported(where, {"submodules": (submodules, None, "the experts' layers are fixed"),
                                   "pg_collection": (pg_collection, None, "groups come from parallel_state")})
        ep = parallel_state.get_expert_model_parallel_world_size()
        if config.num_moe_experts is None or num_local_experts * ep != config.num_moe_experts:
            raise ValueError(f"{where}: num_local_experts ({num_local_experts}) x expert-model-parallel size "
                             f"({ep}) must equal num_moe_experts ({config.num_moe_experts})")
        if config.bias_activation_fusion and not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ValueError(f"{where}: bias_activation_fusion=True fuses SwiGLU only in the experts (as Megatron's "
                             "grouped experts do): use activation_func=F.silu with gated_linear_unit=True, or "
                             "bias_activation_fusion=False")
        self.config = config
        self.num_local_experts = num_local_experts
        self.gated = config.gated_linear_unit
        self.activation_func = config.activation_func
        experts, ffn, hidden = config.num_moe_experts, config.moe_ffn_hidden_size, config.hidden_size
        self.linear_fc1 = ExpertWeight((experts, 2 if self.gated else 1, ffn, hidden), config.init_method, config)
        self.linear_fc2 = ExpertWeight((experts, hidden, ffn), config.output_layer_init_method, config)

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows counts[e] of `x` times weight[e]^T for each local expert e ([n, K] x [e, N, K])."""
        outputs = [F.linear(part, w) for part, w in zip(torch.split(x, counts), weight)]
        return torch.cat(outputs) if outputs else x.new_empty((0, weight.size(1)))

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """activation(fc1 output) times each token's routing weight, in the activation's dtype."""
        weights = probs.unsqueeze(-1)
        if self.config.bias_activation_fusion:
            return weighted_swiglu(h, weights)
        if self.gated:
            gate, up = h.view(h.size(0), 2, -1).unbind(dim=1)
            h = self.activation_func(gate) * up
        else:
            h = self.activation_func(h)
        return (h * weights).to(h.dtype)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert, permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        counts = [int(n) for n in (tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert)
                                   else tokens_per_expert)]
        if len(counts) != self.num_local_experts or sum(counts) != x.size(0) or permuted_probs.shape != x.shape[:1]:
            raise ValueError(f"{type(self).__name__}: {x.size(0)} tokens with {tuple(permuted_probs.shape)} weights "
                             f"do not match tokens_per_expert {counts} ({self.num_local_experts} local experts)")
        fc1 = local_tensor(self.linear_fc1.weight)
        fc1 = fc1.reshape(fc1.size(0), -1, fc1.size(-1))  # [local experts, G x F/ETP, H]
        hidden = self._gemm(x, fc1, counts)
        output = self._gemm(self._activation(hidden, permuted_probs), local_tensor(self.linear_fc2.weight), counts)
        return output, None


class SequentialMLP(_ExpertsBase):
    """The experts one GEMM per local expert (Megatron's SequentialMLP numerics)."""


class GroupedMLP(_ExpertsBase):
    """The experts with one grouped GEMM per layer (torch._grouped_mm) where the device has it:
    CUDA, bf16, compute capability 9.0+, dimensions in multiples of 8; elsewhere one GEMM per
    local expert, as SequentialMLP (the same numbers)."""

    def _use_grouped_mm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if not (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16):
            return False
        if torch.cuda.get_device_capability(x.device) < (9, 0):
            return False
        return x.size(-1) % 8 == 0 and weight.size(1) % 8 == 0  # 16-byte rows for the kernel

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if not self._use_grouped_mm(x, weight):
            return super()._gemm(x, weight, counts)
        offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
        return _torch_compat.grouped_mm(x.contiguous(), weight.transpose(1, 2), offsets)
