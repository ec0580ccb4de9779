"""MoELayer: route, dispatch, run the experts, combine, add the shared expert (Megatron-Core's)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from ... import parallel_state
from ...utils import reject_unsupported
from .experts import GroupedMLP, SequentialMLP
from .router import TopKRouter
from .shared_experts import SharedExpertMLP
from .token_dispatcher import MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher

_DISPATCHERS = {"allgather": MoEAllGatherTokenDispatcher, "alltoall": MoEAlltoAllTokenDispatcher}


@dataclasses.dataclass
class MoESubmodules:
    """Megatron's MoE spec: the classes to build (None: GroupedMLP with moe_grouped_gemm, else
    SequentialMLP; SharedExpertMLP; TopKRouter). They are called with this library's
    constructor signatures (see MoELayer)."""

    experts: Optional[type] = None
    shared_experts: Optional[type] = None
    router: type = TopKRouter


def _check_layout(config) -> None:
    """The config's expert layout must be the one parallel_state was initialized with."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    wanted_etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if (config.expert_model_parallel_size, wanted_etp) != (ep, etp):
        raise ValueError(f"MoELayer: the config's expert_model_parallel_size={config.expert_model_parallel_size} and "
                         f"expert tensor-parallel size {wanted_etp} differ from parallel_state's ({ep}, {etp})")


class MoELayer(nn.Module):
    """forward(hidden_states [s, b, H], padding_mask [b, s] or None (True: padding)) ->
    (output [s, b, H], None). Under sequence parallelism s is this TP rank's part of the
    sequence, and each TP rank routes its own tokens.

    Submodules: `router` (TopKRouter), `token_dispatcher` (by moe_token_dispatcher_type),
    `experts` (GroupedMLP with moe_grouped_gemm, else SequentialMLP: the same parameters) and
    `shared_experts` (SharedExpertMLP with moe_shared_expert_intermediate_size, else None),
    whose output is added to the routed experts'."""

    def __init__(self, config, submodules: Optional[MoESubmodules] = None, layer_number: Optional[int] = None,
                 pg_collection=None, is_mtp_layer: bool = False, name: Optional[str] = None):
        super().__init__()
        reject_unsupported("MoELayer", {"pg_collection": (pg_collection, None, "groups come from parallel_state"),
                                        "is_mtp_layer": (is_mtp_layer, False, "multi-token prediction")})
        if config.num_moe_experts is None:
            raise ValueError("MoELayer needs config.num_moe_experts")
        if submodules is not None and not isinstance(submodules, MoESubmodules):
            raise TypeError(f"MoELayer: submodules must be None or MoESubmodules, got {type(submodules).__name__}")
        _check_layout(config)
        submodules = submodules or MoESubmodules()
        self.config = config
        self.layer_number = layer_number
        ep = parallel_state.get_expert_model_parallel_world_size()
        self.num_local_experts = config.num_moe_experts // ep
        first = parallel_state.get_expert_model_parallel_rank() * self.num_local_experts
        self.local_expert_indices = list(range(first, first + self.num_local_experts))
        self.use_shared_expert = config.moe_shared_expert_intermediate_size is not None
        self.router = submodules.router(config=config)
        self.token_dispatcher = _DISPATCHERS[config.moe_token_dispatcher_type](
            self.num_local_experts, self.local_expert_indices, config=config)
        experts = submodules.experts or (GroupedMLP if config.moe_grouped_gemm else SequentialMLP)
        self.experts = experts(self.num_local_experts, config)
        self.shared_experts = None
        if self.use_shared_expert:
            shared = submodules.shared_experts or SharedExpertMLP
            self.shared_experts = shared(config, gate=config.moe_shared_expert_gate)
        if layer_number is not None:
            self.router.set_layer_number(layer_number)

    def set_layer_number(self, layer_number: int) -> None:
        """The layer's number (from 1): the routers' auxiliary losses are logged per layer."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        return self.router(hidden_states, padding_mask)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return self.token_dispatcher.token_dispatch(hidden_states, probs)

    def shared_experts_compute(self, hidden_states: torch.Tensor) -> Optional[torch.Tensor]:
        return self.shared_experts(hidden_states) if self.shared_experts is not None else None

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        dispatched, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(hidden_states,
                                                                                                   probs)
        expert_output, mlp_bias = self.experts(dispatched, tokens_per_expert, permuted_probs)
        return self.token_dispatcher.combine_preprocess(expert_output), mlp_bias

    def combine(self, output: torch.Tensor) -> torch.Tensor:
        return self.token_dispatcher.token_combine(output)

    def postprocess(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]) -> torch.Tensor:
        output = self.token_dispatcher.combine_postprocess(output)
        return output if shared_expert_output is None else output + shared_expert_output

    def _check_inputs(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> None:
        if hidden_states.dim() != 3 or hidden_states.size(-1) != self.config.hidden_size:
            raise ValueError(f"MoELayer: hidden_states must be [s, b, {self.config.hidden_size}], got "
                             f"{tuple(hidden_states.shape)}")
        expected = (hidden_states.size(1), hidden_states.size(0))
        if padding_mask is not None and tuple(padding_mask.shape) != expected:
            raise ValueError(f"MoELayer: padding_mask must be [b, s] = {expected} (this rank's tokens), got "
                             f"{tuple(padding_mask.shape)}")

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        """Megatron-Core 0.19's signature; intermediate_tensors (its CUDA-graph split) must be None."""
        reject_unsupported("MoELayer.forward", {"intermediate_tensors": (intermediate_tensors, None)})
        self._check_inputs(hidden_states, padding_mask)
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shared_expert_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        hidden, probs = self.preprocess(hidden_states, probs, routing_map)
        dispatched, probs = self.dispatch(hidden, probs)
        output, mlp_bias = self.routed_experts_compute(dispatched, probs)
        output = self.combine(output)
        return self.postprocess(output, shared_expert_output), mlp_bias
