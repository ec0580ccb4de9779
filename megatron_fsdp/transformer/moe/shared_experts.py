"""SharedExpertMLP: the experts every token goes through (Megatron-Core's shared experts)."""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ... import parallel_state
from ...tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from ...tensor_parallel.reset import ResetsDeclaredParameters
from ...tensor_parallel.utils import init_full_tensor, record_init
from ...utils import reject_unsupported
from ..mlp import MLP


class SharedExpertMLP(ResetsDeclaredParameters, MLP):
    """A dense MLP (tensor-parallel, as the layer's) of moe_shared_expert_intermediate_size,
    built as Megatron does: MLP with the config's ffn_hidden_size replaced. With `gate`
    (moe_shared_expert_gate, Qwen2-MoE's) the output is scaled per token by
    sigmoid(x @ gate_weight^T), gate_weight [1, H] replicated (its gradient summed over the TP
    ranks under sequence parallelism). forward(x [s, b, H]) -> output [s, b, H]."""

    def __init__(self, config, submodules=None, gate: Optional[bool] = None, pg_collection=None,
                 name: Optional[str] = None):
        reject_unsupported("SharedExpertMLP", {
            "submodules": (submodules, None, "the shared expert is megatron_fsdp's MLP"),
            "pg_collection": (pg_collection, None, "groups come from parallel_state")})
        if config.moe_shared_expert_intermediate_size is None:
            raise ValueError("SharedExpertMLP needs config.moe_shared_expert_intermediate_size")
        if config.add_bias_linear:
            raise ValueError("SharedExpertMLP has no biases: set add_bias_linear=False")
        config = copy.copy(config)  # NOTE: this MLP's own config: only ffn_hidden_size differs
        config.ffn_hidden_size = config.moe_shared_expert_intermediate_size
        super().__init__(config)
        self.use_shared_expert_gate = config.moe_shared_expert_gate if gate is None else bool(gate)
        if self.use_shared_expert_gate:
            full = init_full_tensor((1, config.hidden_size), config.init_method, config)
            device = full.device if full.device.type == "meta" else parallel_state.get_device()
            self.gate_weight = nn.Parameter(full.to(device=device, dtype=config.params_dtype))
            record_init(self, "gate_weight", config.init_method, config)
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, _ = super().forward(hidden_states)
        if self.use_shared_expert_gate:
            weight = self.gate_weight
            if self.config.sequence_parallel:
                weight = copy_to_tensor_model_parallel_region(weight)
            output = output * torch.sigmoid(F.linear(hidden_states, weight))
        return output
