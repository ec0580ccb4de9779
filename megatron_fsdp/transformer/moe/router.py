"""TopKRouter: Megatron-Core's router (gating linear, top-k routing, capacity, auxiliary losses,
aux-loss-free expert bias)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ... import parallel_state
from ...tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from ...tensor_parallel.random import in_activation_recomputation
from ...tensor_parallel.reset import ResetsDeclaredParameters
from ...tensor_parallel.utils import init_full_tensor, record_init
from ...utils import reject_unsupported
from .moe_logging import get_moe_metrics_tracker
from .moe_utils import (
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    compute_routing_scores_for_aux_loss,
    get_tokens_per_expert_and_token_count,
    switch_load_balancing_loss_func,
    topk_routing_with_score_function,
    z_loss_func,
)

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


class RouterGatingLinearFunction(torch.autograd.Function):
    """logits = input @ weight^T computed in the router dtype, keeping the inputs as they are for
    backward (not their router-dtype copies); gradients come back in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, inp, weight, router_dtype):
        ctx.save_for_backward(inp, weight)
        ctx.router_dtype = router_dtype
        return torch.matmul(inp.to(router_dtype), weight.to(router_dtype).t())

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        grad_input = torch.matmul(grad_output, weight.to(ctx.router_dtype)).to(inp.dtype)
        grad_weight = torch.matmul(grad_output.reshape(-1, grad_output.size(-1)).t(),
                                   inp.reshape(-1, inp.size(-1)).to(ctx.router_dtype)).to(weight.dtype)
        return grad_input, grad_weight, None


def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, router_dtype: torch.dtype) -> torch.Tensor:
    return RouterGatingLinearFunction.apply(inp, weight, router_dtype)


class TopKRouter(ResetsDeclaredParameters, nn.Module):
    """Routes each token to its top-k experts. forward(input [s, b, h]) -> (probs [s*b, E], each
    token's expert weights, zero elsewhere; routing_map [s*b, E] bool).

    `weight` [E, h] is replicated; under sequence parallelism each TP rank routes its own tokens
    and the weight's gradient is summed over the TP ranks (as a norm weight's). With
    moe_router_enable_expert_bias the fp32 buffer `expert_bias` [E] steers the choice of experts
    and `local_tokens_per_expert` [E] counts this rank's routed tokens until
    moe_utils._update_router_expert_bias (once per global batch) updates the bias from them.
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False):
        super().__init__()
        reject_unsupported("TopKRouter", {"pg_collection": (pg_collection, None, "groups come from parallel_state"),
                                          "is_mtp_layer": (is_mtp_layer, False, "multi-token prediction")})
        if config.num_moe_experts is None:
            raise ValueError("TopKRouter needs config.num_moe_experts")
        self.config = config
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.score_function = config.moe_router_score_function
        self.layer_number: Optional[int] = None
        self.frozen_expert_bias = False
        self.tp_cp_group = parallel_state.get_tensor_and_context_parallel_group()
        self.tp_dp_cp_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        full = init_full_tensor((self.num_experts, config.hidden_size), config.init_method, config)
        device = full.device if full.device.type == "meta" else parallel_state.get_device()
        self.weight = nn.Parameter(full.to(device=device, dtype=config.params_dtype))
        record_init(self, "weight", config.init_method, config)
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        if self.enable_expert_bias:
            zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=device)
            self.register_buffer("local_tokens_per_expert", zeros.clone(), persistent=False)
            self.register_buffer("expert_bias", zeros.clone())
        else:
            self.local_tokens_per_expert = None
            self.expert_bias = None

    def reset_buffers(self) -> None:
        """Zero the expert bias and its token counts (a meta-device model's buffers start empty)."""
        if self.enable_expert_bias:
            with torch.no_grad():
                self.expert_bias.zero_()
                self.local_tokens_per_expert.zero_()

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def _maintain_float32_expert_bias(self) -> None:
        # A module-wide .to(bfloat16) casts buffers too; the bias steps by 1e-3 and needs fp32.
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.to(torch.float32)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Logits [s, b, E] in the router dtype (moe_router_dtype; else the input's)."""
        router_dtype = _ROUTER_DTYPES[self.config.moe_router_dtype] or input.dtype
        weight = self.weight
        if self.config.sequence_parallel:
            weight = copy_to_tensor_model_parallel_region(weight)
        return router_gating_linear(input, weight, router_dtype)

    # ------------------------------------------------------------ auxiliary losses

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        return self.config.moe_aux_loss_coeff if self.routing_type == aux_loss_type else 0.0

    def is_aux_loss_enabled(self) -> bool:
        return any(self.get_aux_loss_coeff(kind) > 0 for kind in ("aux_loss", "seq_aux_loss"))

    def _records(self) -> bool:
        # A checkpointed forward runs again in backward: its losses and counts are the first run's.
        return self.training and torch.is_grad_enabled() and not in_activation_recomputation()

    def attach_and_log_load_balancing_loss(self, activation: torch.Tensor, aux_loss_coeff: float,
                                           aux_loss: torch.Tensor, aux_loss_name: str, reduce_group,
                                           needs_dp_avg: bool = True, valid_token_count=None) -> torch.Tensor:
        """Log the loss (without its coefficient) and attach it to `activation`'s backward."""
        if self._records():
            get_moe_metrics_tracker().record(aux_loss_name, aux_loss / aux_loss_coeff, self.layer_number,
                                             self.config.num_layers, reduce_group=reduce_group,
                                             needs_dp_avg=needs_dp_avg)
        return MoEAuxLossAutoScaler.apply(activation, aux_loss)

    def _apply_aux_loss(self, probs, scores, routing_map, with_padding_mask: bool):
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert, _, total = get_tokens_per_expert_and_token_count(
            routing_map, self.tp_cp_group, self.topk, with_padding_mask)
        aux_loss = switch_load_balancing_loss_func(scores, tokens_per_expert, total, self.topk,
                                                   self.num_experts, coeff)
        return self.attach_and_log_load_balancing_loss(probs, coeff, aux_loss, "load_balancing_loss",
                                                       self.tp_cp_group)

    def _apply_seq_aux_loss(self, probs, scores, routing_map, seq_length: int, bsz: int, with_padding_mask: bool):
        """Megatron's per-sequence loss: the batch folded into the expert dimension ([s, b*E]),
        so the switch loss of that is the sum of the sequences' losses; then their mean."""
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        scores = scores.reshape(seq_length, -1)
        routing_map = routing_map.reshape(seq_length, -1)
        tokens_per_expert, _, total = get_tokens_per_expert_and_token_count(
            routing_map, self.tp_cp_group, self.topk * bsz, with_padding_mask)
        aux_loss = switch_load_balancing_loss_func(scores, tokens_per_expert, total, self.topk,
                                                   self.num_experts, coeff) / bsz
        return self.attach_and_log_load_balancing_loss(probs, coeff, aux_loss, "seq_load_balancing_loss",
                                                       self.tp_cp_group)

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attach the z-loss to the logits' backward. Each TP x CP rank takes the mean over its
        tokens with coeff / (TP x CP): the ranks' losses add up to the mean over the sequences."""
        coeff = self.config.moe_z_loss_coeff
        # None or 0: no z-loss (Megatron would compute one times 0 and log it divided by 0).
        if not coeff or not (self.training and torch.is_grad_enabled()):
            return logits
        scaled = coeff / self.tp_cp_group.size()
        z_loss = z_loss_func(logits, scaled, padding_mask=padding_mask)
        logits = MoEAuxLossAutoScaler.apply(logits, z_loss)
        if self._records():
            get_moe_metrics_tracker().record("z_loss", z_loss / scaled, self.layer_number, self.config.num_layers,
                                             avg_group=self.tp_dp_cp_group)
        return logits

    # ------------------------------------------------------------ routing

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> None:
        """Count this rank's routed tokens per expert for the bias update (training only)."""
        if self.enable_expert_bias and self._records():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """Logits [s, b, E] -> (probs [s*b, E], routing_map [s*b, E]). `padding_mask` [s, b]:
        True marks a padding token: routed as any other, left out of the losses and counts."""
        seq_length, bsz = logits.shape[:2]
        logits = logits.reshape(-1, self.num_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask)
        config = self.config
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=config.moe_router_pre_softmax,
            scaling_factor=config.moe_router_topk_scaling_factor, score_function=self.score_function,
            expert_bias=self.expert_bias)
        if config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, router_topk=self.topk, capacity_factor=config.moe_expert_capacity_factor,
                drop_policy=config.moe_token_drop_policy, pad_to_capacity=config.moe_pad_expert_input_to_capacity)
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            aux_map, aux_scores = compute_routing_scores_for_aux_loss(logits, self.topk, self.score_function,
                                                                      padding_mask=padding_mask)
            masked = padding_mask is not None
            probs = self._apply_aux_loss(probs, aux_scores, aux_map, masked)
            probs = self._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz, masked)
        self._apply_expert_bias(routing_map, padding_mask)
        return probs, routing_map

    def forward(self, input: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        if input.dim() != 3 or input.size(-1) != self.config.hidden_size:
            raise ValueError(f"TopKRouter: input must be [s, b, {self.config.hidden_size}], got {tuple(input.shape)}")
        if padding_mask is not None and (padding_mask.dtype != torch.bool
                                         or tuple(padding_mask.shape) != tuple(input.shape[:2])):
            raise ValueError(f"TopKRouter: padding_mask must be bool [s, b] = {tuple(input.shape[:2])}, got "
                             f"{padding_mask.dtype} {tuple(padding_mask.shape)}")
        self._maintain_float32_expert_bias()
        return self.routing(self.gating(input), padding_mask=padding_mask)
