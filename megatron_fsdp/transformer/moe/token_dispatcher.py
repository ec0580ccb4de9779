"""Token dispatchers: bring each token to the ranks holding its experts and the experts'
outputs back (Megatron-Core's MoEAllGatherTokenDispatcher and MoEAlltoAllTokenDispatcher).

Notation: t tokens of this rank ([s/TP, b] flattened), E experts, EP expert-model-parallel and
ETP expert-tensor-parallel ranks, E/EP local experts. Every rank of the EP x ETP group holds
different tokens (its own micro-batch, or its sequence-parallel part of one). The experts apply
the routing weights; combining sums each token's experts' outputs. Each dispatch asks the
device for its token counts once (one host copy), as Megatron does: all-to-all split sizes and
the experts' GEMM sizes are host ints.
"""

from __future__ import annotations

import torch

from ... import parallel_state
from ...tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from ...utils import reject_unsupported
from .moe_utils import get_capacity, permute, sort_chunks_by_idxs, unpermute


class MoETokenDispatcher:
    """The dispatch/combine protocol MoELayer drives (Megatron's method names)."""

    def __init__(self, config, pg_collection=None) -> None:
        reject_unsupported(type(self).__name__, {
            "pg_collection": (pg_collection, None, "groups come from parallel_state")})
        self.config = config
        self.shared_experts = None
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.tp_group = parallel_state.get_expert_tensor_parallel_group()
        self.tp_ep_group = parallel_state.get_expert_tensor_and_model_parallel_group()
        self.tp_size = self.tp_group.size()
        self.tp_rank = self.tp_group.rank()
        self.ep_size = self.ep_group.size()
        self.ep_rank = self.ep_group.rank()
        if self.tp_ep_group.rank() != self.ep_rank * self.tp_size + self.tp_rank:
            # NOTE: the counts gathered over the EP x ETP group are read as [EP, ETP, E].
            raise ValueError("the expert tensor x model parallel group must order its ranks expert-TP fastest "
                             "(Megatron's layout, order='tp-cp-ep-dp-pp')")

    def set_shared_experts(self, shared_experts):
        raise NotImplementedError("moe_shared_expert_overlap is not supported: the shared expert runs "
                                  "outside the dispatcher")


def _check_local_experts(num_local_experts: int, local_expert_indices: list[int], config, ep_size: int,
                         ep_rank: int) -> None:
    expected = list(range(ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts))
    if num_local_experts * ep_size != config.num_moe_experts or list(local_expert_indices) != expected:
        raise ValueError(f"local experts {list(local_expert_indices)} ({num_local_experts} of "
                         f"{config.num_moe_experts}) are not expert-parallel rank {ep_rank}'s of {ep_size}: "
                         f"expected {expected}")


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather every token of the EP x ETP group, compute the local experts' share, and
    reduce-scatter the sums back (each rank its tokens)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None):
        super().__init__(config, pg_collection)
        _check_local_experts(num_local_experts, local_expert_indices, config, self.ep_size, self.ep_rank)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.router_topk = config.moe_router_topk

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.reshape(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.tp_ep_group.size() > 1:
            with torch.no_grad():
                self.routing_map = gather_from_sequence_parallel_region(self.routing_map, group=self.tp_ep_group)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_ep_group)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """(the local experts' tokens grouped by expert, tokens per local expert (host), their weights)."""
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, first:last].contiguous()
        local_probs = probs[:, first:last].contiguous()
        # NOTE: the one host copy of this dispatch.
        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()
        permuted, local_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, self.local_map, probs=local_probs, num_out_tokens=int(tokens_per_expert.sum()))
        self.routing_map = None
        # NOTE: only the dtype is kept: a tensor with autograd history held by the module would keep
        # the graph, FSDP's hooks in it and so the model and its process groups alive after the job.
        self.probs_dtype = local_probs.dtype
        return permuted, tokens_per_expert, local_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return unpermute(hidden_states, self.reversed_local_input_permutation_mapping,
                         restore_shape=self.hidden_shape_before_permute, routing_map=self.local_map)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.tp_ep_group.size() > 1:
            # Summed in the routing weights' dtype (Megatron's; fp32 with moe_router_dtype="fp32").
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.probs_dtype), group=self.tp_ep_group).to(hidden_states.dtype)
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """Permute this rank's tokens by expert, all-to-all them over EP (variable split sizes),
    all-gather over expert TP, sort the chunks by local expert; the reverse to combine
    (Megatron's flow). With moe_pad_expert_input_to_capacity every expert gets exactly its
    capacity of tokens from every rank, and the counts need no host copy."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None):
        super().__init__(config, pg_collection)
        _check_local_experts(num_local_experts, local_expert_indices, config, self.ep_size, self.ep_rank)
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        chunks = torch.arange(self.num_experts * self.tp_size)
        # The received chunks are [ETP rank, EP rank, local expert]: these orders group them by
        # local expert, and back.
        self.sort_input_by_local_experts = chunks.reshape(-1, num_local_experts).T.ravel().tolist()
        self.restore_output_by_local_experts = chunks.reshape(num_local_experts, -1).T.ravel().tolist()
        self.drop_and_pad = config.moe_pad_expert_input_to_capacity

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        """The split sizes of this dispatch, on the host; returns tokens per local expert (host)."""
        if self.drop_and_pad:
            self.capacity = get_capacity(routing_map.size(0) * self.config.moe_router_topk, self.num_experts,
                                         self.config.moe_expert_capacity_factor)
            self.num_out_tokens = self.capacity * self.num_experts
            self.input_splits = self.output_splits = self.output_splits_tp = None  # equal parts
            self.num_global_tokens_per_local_expert = [self.capacity] * (self.num_experts * self.tp_size)
            return torch.full((self.num_local_experts,), self.capacity * self.tp_size * self.ep_size,
                              dtype=torch.long)
        local_counts = routing_map.sum(dim=0).long()  # [E]
        if self.tp_ep_group.size() > 1:
            # [EP, ETP, E]: how many tokens each rank of the group sends to each expert.
            everyone = gather_from_sequence_parallel_region(local_counts, group=self.tp_ep_group)
            everyone = everyone.reshape(self.ep_size, self.tp_size, self.num_experts).transpose(0, 1)
        else:
            everyone = local_counts.reshape(1, 1, self.num_experts)
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        for_local = everyone[:, :, first:last]  # [ETP, EP, local experts]
        per_rank = for_local.sum(dim=2)  # [ETP, EP]
        host = torch.cat([local_counts.reshape(self.ep_size, -1).sum(dim=1), per_rank[self.tp_rank],
                          per_rank.sum(dim=1), for_local.reshape(-1), for_local.sum(dim=(0, 1))]).tolist()
        # NOTE: `host` is the one host copy of this dispatch; everything below slices it.
        ep, tp, chunks = self.ep_size, self.tp_size, for_local.numel()
        self.input_splits, self.output_splits = host[:ep], host[ep:2 * ep]
        self.output_splits_tp = host[2 * ep:2 * ep + tp]
        self.num_global_tokens_per_local_expert = host[2 * ep + tp:2 * ep + tp + chunks]
        self.num_out_tokens = sum(self.input_splits)
        return torch.tensor(host[2 * ep + tp + chunks:], dtype=torch.long)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(routing_map)
        self.hidden_shape_before_permute = hidden_states.shape
        self.probs_dtype = probs.dtype
        permuted, permuted_probs, self.reversed_local_input_permutation_mapping = permute(
            hidden_states, routing_map, probs=probs, num_out_tokens=self.num_out_tokens,
            drop_and_pad=self.drop_and_pad)
        return permuted, permuted_probs

    def token_dispatch(self, permuted_tokens: torch.Tensor, permuted_probs: torch.Tensor):
        tokens = all_to_all(self.ep_group, permuted_tokens, self.output_splits, self.input_splits)
        probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
        return tokens, probs

    def _by_local_expert(self, x: torch.Tensor, order: list[int], sizes: list[int], *, to_experts: bool):
        """Regroup the received chunks [ETP rank, EP rank, local expert] by local expert, or back."""
        if self.drop_and_pad:
            ranks, capacity = self.tp_size * self.ep_size, self.capacity
            shape = (ranks, self.num_local_experts) if to_experts else (self.num_local_experts, ranks)
            return x.view(*shape, capacity, *x.shape[1:]).transpose(0, 1).contiguous().flatten(0, 2)
        return sort_chunks_by_idxs(x, sizes, order)[0]

    def dispatch_postprocess(self, tokens: torch.Tensor, probs: torch.Tensor):
        if self.tp_size > 1:
            tokens = gather_from_sequence_parallel_region(tokens, group=self.tp_group,
                                                          output_split_sizes=self.output_splits_tp)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_group,
                                                         output_split_sizes=self.output_splits_tp)
        if self.num_local_experts > 1:
            sizes = self.num_global_tokens_per_local_expert
            tokens = self._by_local_expert(tokens, self.sort_input_by_local_experts, sizes, to_experts=True)
            probs = self._by_local_expert(probs, self.sort_input_by_local_experts, sizes, to_experts=True)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return tokens, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.num_local_experts > 1:
            # The chunks by local expert are in the transposed order: [local expert, ETP, EP].
            sizes = torch.tensor(self.num_global_tokens_per_local_expert).view(-1, self.num_local_experts)
            hidden_states = self._by_local_expert(hidden_states, self.restore_output_by_local_experts,
                                                  sizes.T.ravel().tolist(), to_experts=False)
        if self.tp_size > 1:
            hidden_states = reduce_scatter_to_sequence_parallel_region(
                hidden_states.to(self.probs_dtype), group=self.tp_group,
                input_split_sizes=self.output_splits_tp).to(hidden_states.dtype)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return all_to_all(self.ep_group, hidden_states, self.input_splits, self.output_splits)

    def combine_postprocess(self, permuted_tokens: torch.Tensor) -> torch.Tensor:
        output = unpermute(permuted_tokens, self.reversed_local_input_permutation_mapping,
                           restore_shape=self.hidden_shape_before_permute, routing_map=self.routing_map,
                           drop_and_pad=self.drop_and_pad)
        return output.view(self.hidden_shape)
