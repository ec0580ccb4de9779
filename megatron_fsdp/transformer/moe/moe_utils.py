"""Mixture-of-experts building blocks with Megatron-Core's names and numerics.

Routing (top-k with a score function, token dropping to a capacity), the load-balancing and
z-losses and the autograd trick that adds them to the backward pass, token permutation, and
the aux-loss-free expert-bias update. The logging tracker of the auxiliary losses is in
moe_logging.py; its Megatron function names are re-exported here, where Megatron-Core has them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ... import parallel_state
from ...tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from .moe_logging import (  # Megatron-Core's moe_utils names
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
    save_to_aux_losses_tracker,
    track_moe_metrics,
)

__all__ = [
    "MoEAuxLossAutoScaler", "apply_router_token_dropping", "clear_aux_losses_tracker",
    "compute_routing_scores_for_aux_loss", "get_capacity", "get_moe_layer_wise_logging_tracker",
    "get_tokens_per_expert_and_token_count", "get_updated_expert_bias", "permute",
    "reduce_aux_losses_tracker_across_ranks", "reset_model_temporary_tensors", "save_to_aux_losses_tracker",
    "sort_chunks_by_idxs", "switch_load_balancing_loss_func", "topk_routing_with_score_function",
    "track_moe_metrics", "unpermute", "z_loss_func",
]


# ---------------------------------------------------------------- auxiliary losses


def switch_load_balancing_loss_func(probs: torch.Tensor, tokens_per_expert: torch.Tensor, total_num_tokens,
                                    topk: int, num_experts: int, moe_aux_loss_coeff: float,
                                    fused: bool = False, padding_mask: Optional[torch.Tensor] = None
                                    ) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, as Megatron computes it:
    coeff * E / (topk * T^2) * sum_e (sum_t probs[t, e]) * tokens_per_expert[e].

    `probs` are this rank's tokens' scores [t, E]; `tokens_per_expert` and `total_num_tokens` T
    count the tokens of the whole sequences (summed over the tensor- and context-parallel ranks
    that share them), so the ranks' losses add up to the sequences' loss. `padding_mask` [t]:
    True keeps a token."""
    if fused:
        raise NotImplementedError("switch_load_balancing_loss_func: fused=True (Transformer Engine) is not supported")
    if padding_mask is not None:
        probs = probs * padding_mask.unsqueeze(-1)
    aggregated = probs.sum(dim=0)
    return torch.sum(aggregated * tokens_per_expert) * (
        num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens))


def z_loss_func(logits: torch.Tensor, z_loss_coeff: float, padding_mask: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff * mean over tokens of logsumexp(logits)^2. `padding_mask`
    [t]: True marks a padding token, left out of the mean."""
    squares = torch.square(torch.logsumexp(logits, dim=-1))
    if padding_mask is None:
        return torch.mean(squares) * z_loss_coeff
    valid = ~padding_mask
    return (squares * valid).sum() / torch.clamp(valid.sum(), min=1.0) * z_loss_coeff


def get_tokens_per_expert_and_token_count(routing_map: torch.Tensor, reduce_group: dist.ProcessGroup,
                                          topk: Optional[int] = None, with_padding_mask: bool = False):
    """(tokens per expert summed over `reduce_group`, this rank's token count, the group's token
    count). With a padding mask (already applied to `routing_map`) the counts are of real tokens."""
    local_tokens_per_expert = routing_map.sum(dim=0)
    global_tokens_per_expert = reduce_from_tensor_model_parallel_region(local_tokens_per_expert, reduce_group)
    if with_padding_mask:
        return (global_tokens_per_expert, local_tokens_per_expert.sum() / topk,
                global_tokens_per_expert.sum() / topk)
    local_num_tokens = routing_map.shape[0]
    return global_tokens_per_expert, local_num_tokens, local_num_tokens * dist.get_world_size(reduce_group)


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Returns `output` unchanged and makes backward also differentiate `aux_loss` with the
    gradient `main_loss_backward_scale` (1 until set_loss_scale is called): the auxiliary loss
    joins the main loss without being added to it. The training loop sets the scale each step
    to what scales the main loss (Megatron: grad scale x CP size / number of micro-batches)."""

    main_loss_backward_scale: Optional[torch.Tensor] = None

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        if scale is None:
            scale = MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(1.0, device=aux_loss.device)
        return grad_output, torch.ones_like(aux_loss) * scale

    @staticmethod
    def set_loss_scale(scale) -> None:
        """Set the scale of the auxiliary losses' gradients (a number or a scalar tensor)."""
        if not torch.is_tensor(scale):
            scale = torch.tensor(float(scale))
        # NOTE: a 0-dim tensor, replaced (not copied into): callers pass numbers, [1] tensors (the
        # training loop's, on the loss's device) or 0-dim ones, and any may follow any other.
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale.detach().reshape(()).clone()


# ---------------------------------------------------------------- routing


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: Optional[int] = None
                 ) -> int:
    """Tokens an expert takes: ceil(num_tokens / num_experts * capacity_factor), at least min_capacity."""
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def _scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    if score_function == "sigmoid":
        return torch.sigmoid(logits.float())
    raise ValueError(f"score_function must be 'softmax' or 'sigmoid', got {score_function!r}")


def _topk_probs(logits, topk, use_pre_softmax, score_function, expert_bias):
    """(probs [t, k] in fp32, indices [t, k]) before any scaling."""
    if score_function == "softmax":
        if use_pre_softmax:
            return torch.topk(_scores(logits, "softmax"), k=topk, dim=1)
        top_logits, indices = torch.topk(logits, k=topk, dim=1)
        return torch.softmax(top_logits, dim=-1, dtype=torch.float32), indices
    scores = _scores(logits, score_function)
    if expert_bias is not None:
        # NOTE: the bias steers the choice of experts only; the weights are the unbiased scores.
        _, indices = torch.topk(scores + expert_bias.float(), k=topk, dim=1)
        scores = torch.gather(scores, dim=1, index=indices)
    else:
        scores, indices = torch.topk(scores, k=topk, dim=1)
    return (scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores), indices


def topk_routing_with_score_function(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                                     num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                                     scaling_factor: Optional[float] = None, score_function: str = "softmax",
                                     expert_bias: Optional[torch.Tensor] = None, fused: bool = False):
    """Megatron's top-k routing of logits [t, E]: (probs [t, E], the top-k weights of each token
    in the logits' dtype, zero elsewhere; routing_map [t, E] bool). softmax: over the top-k
    logits, or (use_pre_softmax) over all E before choosing; sigmoid: the chosen scores
    normalized to sum 1 (when topk > 1), `expert_bias` added for the choice only. Then times
    `scaling_factor`. Scores are computed in fp32."""
    if logits.dim() != 2:
        raise ValueError(f"topk_routing_with_score_function: logits must be [tokens, experts], got "
                         f"{tuple(logits.shape)}")
    if num_groups is not None or group_topk is not None or fused:
        raise NotImplementedError("topk_routing_with_score_function: group-limited routing and fused=True "
                                  "are not supported")
    probs, indices = _topk_probs(logits, topk, use_pre_softmax, score_function, expert_bias)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


def compute_routing_scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str,
                                        fused: bool = False, padding_mask: Optional[torch.Tensor] = None):
    """(routing map, scores) the load-balancing losses see: every expert's score (softmax, or
    sigmoid normalized over the experts) and the plain top-k of it: no expert bias, no capacity.
    `padding_mask` [t]: True marks a padding token, whose row is zeroed."""
    if fused:
        raise NotImplementedError("compute_routing_scores_for_aux_loss: fused=True is not supported")
    scores = _scores(logits, score_function)
    if score_function == "sigmoid":
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, indices = torch.topk(scores, k=topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    if padding_mask is not None:
        valid = (~padding_mask).unsqueeze(-1)
        routing_map = routing_map & valid
        scores = scores * valid
    return routing_map, scores


def _capacity_mask(routing_probs, routing_map, capacity: int, drop_policy: str) -> torch.Tensor:
    """[t, E] bool: the `capacity` tokens each expert keeps (routed ones first)."""
    if drop_policy == "probs":
        # Routed tokens have positive weights, the others zero: the routed ones come first.
        _, keep = torch.topk(routing_probs, k=capacity, dim=0, sorted=False)
    elif drop_policy == "position":
        # NOTE: routed tokens first, each group by position (earliest first); a topk of 0/1 alone
        # would leave the choice among equals to the kernel.
        num_tokens = routing_map.size(0)
        position = torch.arange(num_tokens, 0, -1, device=routing_map.device, dtype=torch.float32)
        rank = routing_map.float() * (num_tokens + 1) + position.unsqueeze(-1)
        _, keep = torch.topk(rank, k=capacity, dim=0, sorted=False)
    else:
        raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    return torch.zeros_like(routing_map).scatter(0, keep, True)


def apply_router_token_dropping(routing_probs: torch.Tensor, routing_map: torch.Tensor, router_topk: int,
                                capacity_factor: float, drop_policy: str = "probs", pad_to_capacity: bool = False):
    """Each expert keeps at most capacity = ceil(t * topk / E * capacity_factor) of its tokens
    (by weight, "probs", or earliest, "position"); a dropped token skips that expert (its
    residual carries it). pad_to_capacity: every expert gets exactly `capacity` tokens, the extra
    ones with weight zero. Returns (probs, routing_map) after dropping."""
    num_tokens, num_experts = routing_probs.shape
    capacity = get_capacity(num_tokens * router_topk, num_experts, capacity_factor)
    if capacity > num_tokens:
        capacity_mask = torch.ones_like(routing_map)  # nothing to drop
    else:
        capacity_mask = _capacity_mask(routing_probs, routing_map, capacity, drop_policy)
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map, final_map


# ---------------------------------------------------------------- permutation


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
            num_out_tokens: Optional[int] = None, fused: bool = False, drop_and_pad: bool = False):
    """Tokens [t, h] grouped by expert: expert 0's tokens in token order, then expert 1's, ...
    Returns (permuted tokens [n, h], permuted probs [n] or None, sorted_indices [n]: the token
    each row came from). `num_out_tokens` n: the routed (token, expert) pairs (a host int: no
    sync). drop_and_pad: every expert has exactly n / E tokens (moe_pad_expert_input_to_capacity)."""
    if fused:
        raise NotImplementedError("permute: fused=True (Transformer Engine) is not supported")
    if num_out_tokens is None:
        raise ValueError("permute: num_out_tokens is required (the number of routed token-expert pairs)")
    num_tokens, num_experts = routing_map.shape
    by_expert = routing_map.T.contiguous()
    if drop_and_pad:
        capacity = num_out_tokens // num_experts
        rows = by_expert.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[:, :capacity]
        flat = (rows + torch.arange(num_experts, device=rows.device).unsqueeze(-1) * num_tokens).reshape(-1)
    else:
        # A stable sort of the flattened [E, t] map puts the routed pairs first, in expert-major
        # order, without asking the device how many there are.
        flat = by_expert.reshape(-1).to(torch.int8).argsort(descending=True, stable=True)[:num_out_tokens]
    sorted_indices = flat % num_tokens
    permuted_probs = None if probs is None else probs.T.contiguous().reshape(-1)[flat]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
              probs: Optional[torch.Tensor] = None, routing_map: Optional[torch.Tensor] = None,
              fused: bool = False, drop_and_pad: bool = False) -> torch.Tensor:
    """permute's inverse: each row added back to the token it came from (a token's experts
    summed), in the input's dtype. `probs` [t, E] with `routing_map`: rows weighted first."""
    if fused:
        raise NotImplementedError("unpermute: fused=True (Transformer Engine) is not supported")
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        if routing_map is None:
            raise ValueError("unpermute: probs need the routing_map they were permuted with")
        by_expert = probs.T.contiguous()
        if drop_and_pad:
            num_experts = routing_map.size(1)
            rows = sorted_indices.view(num_experts, -1)
            flat = rows + torch.arange(num_experts, device=rows.device).unsqueeze(-1) * probs.size(0)
            weights = by_expert.view(-1).index_select(0, flat.view(-1))
        else:
            weights = by_expert.masked_select(routing_map.T.contiguous())
        permuted_tokens = permuted_tokens * weights.unsqueeze(-1)
    output = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    output.index_add_(0, sorted_indices, permuted_tokens)
    return output.to(input_dtype)


def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: list[int], sorted_idxs: list[int],
                        probs: Optional[torch.Tensor] = None, fused: bool = False):
    """Cut `input` (and `probs`) into chunks of `split_sizes` rows and lay them out in the order
    `sorted_idxs`. Sizes and order are host ints (a loop over chunks, not tokens)."""
    if fused:
        raise NotImplementedError("sort_chunks_by_idxs: fused=True is not supported")
    chunks = torch.split(input, list(split_sizes), dim=0)
    output = torch.cat([chunks[i] for i in sorted_idxs], dim=0)
    if probs is None:
        return output, None
    prob_chunks = torch.split(probs, list(split_sizes), dim=0)
    return output, torch.cat([prob_chunks[i] for i in sorted_idxs], dim=0)


# ---------------------------------------------------------------- aux-loss-free balancing


def get_updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                            expert_bias_update_rate: float,
                            tp_dp_cp_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free update (Megatron's): sum the token counts over the tensor,
    data and context parallel ranks (in place), then move each expert's bias by the update rate
    towards balance: + rate under the mean count, - rate over it. Works on stacked [layers, E]."""
    with torch.no_grad():
        if tp_dp_cp_group is None:
            tp_dp_cp_group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
        dist.all_reduce(tokens_per_expert, group=tp_dp_cp_group)
        average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        return expert_bias + torch.sign(average - tokens_per_expert) * expert_bias_update_rate


def _routers_with_expert_bias(model) -> list:
    modules = [m for chunk in model for m in chunk.modules()]
    return [m for m in modules if getattr(m, "expert_bias", None) is not None and m.training
            and not getattr(m, "frozen_expert_bias", False)]


def _update_router_expert_bias(model: list, config, tp_dp_cp_group: Optional[dist.ProcessGroup] = None) -> None:
    """Every training router's expert bias updated from its tokens of the global batch (one
    all-reduce for all layers), as Megatron's finalize_model_grads does after the backward of the
    last micro-batch. Call reset_model_temporary_tensors afterwards to start counting anew."""
    routers = _routers_with_expert_bias(model)
    if not routers:  # a model with dense layers only
        return
    counts = torch.stack([r.local_tokens_per_expert for r in routers])
    biases = torch.stack([r.expert_bias for r in routers])
    updated = get_updated_expert_bias(counts, biases, config.moe_router_bias_update_rate, tp_dp_cp_group)
    for router, bias in zip(routers, updated):
        router.expert_bias.copy_(bias)


def reset_model_temporary_tensors(config, model: list) -> None:
    """Zero the routers' token counts of the expert-bias update (Megatron's, once per global batch)."""
    for chunk in model:
        for module in chunk.modules():
            if config.moe_router_enable_expert_bias and getattr(module, "local_tokens_per_expert", None) is not None:
                module.local_tokens_per_expert.zero_()
