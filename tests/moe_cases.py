"""Pieces of the MoE pool cases: a layout, a layer with known weights, each rank's tokens, and the
layer's gradients summed over the ranks that share them, to compare with tests/moe_reference.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor

import moe_reference
from helpers import full_tensor, make_config, setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.tensor_parallel import partition_stride
from megatron_fsdp.transformer.moe import MoEAuxLossAutoScaler, MoELayer

# fp32 through the same formulas in another order: agreement to ~1e-6 of the values' scale; a bug is
# off by far more.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal to 1e-5, relative to the tensor's largest value (a gradient summed over many tokens
    is large, and so are its rounding errors)."""
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=TOLERANCE["rtol"], atol=TOLERANCE["atol"] * scale,
                               msg=lambda m: f"{what}: {m}")
S, B = 8, 2


def setup(tp: int = 1, ep: int = 1, etp=None, seed: int = 1234, cp: int = 1) -> None:
    setup_parallel(tp, seed=seed, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                   context_parallel_size=cp)
    MoEAuxLossAutoScaler.set_loss_scale(1.0)


def moe_config(**overrides):
    """A one-layer config with 4 experts (top-2) at the parallel state's layout."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    fields = dict(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, add_bias_linear=False,
                  context_parallel_size=parallel_state.get_context_parallel_world_size(),
                  num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, gated_linear_unit=True,
                  activation_func=F.silu, sequence_parallel=tp > 1,
                  expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                  expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size())
    fields.update(overrides)
    return make_config(**fields)


@torch.no_grad()
def write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Give a parameter (a DTensor on any mesh, TP-strided or not, or plain) the full value `full`."""
    if isinstance(param, DTensor):
        stride, tp = partition_stride.stride_of(param), parallel_state.get_tensor_model_parallel_world_size()
        blocks = partition_stride.to_blocks(full, stride, tp) if param.device_mesh.ndim == 1 else full
        local = distribute_tensor(blocks, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def build(config, weights: moe_reference.Weights) -> MoELayer:
    layer = MoELayer(config, layer_number=1)
    for name, full in weights.named().items():
        write_full(layer.get_parameter(name), full)
    if weights.expert_bias is not None:
        layer.router.expert_bias.copy_(weights.expert_bias)
    return layer


def chunks() -> int:
    """How many ranks share a micro-batch's sequences (tensor x context parallel)."""
    return parallel_state.get_tensor_and_context_parallel_world_size()


def replica_and_chunk() -> tuple[int, int]:
    """This rank's micro-batch (its data-parallel rank) and its part of the sequence (its rank
    among the tensor x context parallel ranks: which part does not matter to the layer, only
    that the reference routes the same parts)."""
    return parallel_state.get_data_parallel_rank(), parallel_state.get_tensor_and_context_parallel_rank()


def data(config, padded: bool = False, seed: int = 7):
    """(x [R, S, B, H], grad_out, padding [R, B, S] or None): the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    R = parallel_state.get_data_parallel_world_size()
    x = torch.randn(R, S, B, config.hidden_size, generator=g)
    grad_out = torch.randn(R, S, B, config.hidden_size, generator=g)
    padding = (torch.rand(R, B, S, generator=g) < 0.3) if padded else None
    return x, grad_out, padding


def local(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """This rank's part of a [R, ...] tensor: its replica, its chunk of the sequence dim."""
    replica, chunk = replica_and_chunk()
    return t[replica].chunk(chunks(), dim=seq_dim - 1)[chunk].contiguous()


def full_grads(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's full gradient over every rank's tokens: expert gradients summed over
    the expert-data-parallel ranks, the others over the data x context parallel ranks (the TP
    sum of a replicated weight under sequence parallelism is the layer's own), then unsharded."""
    grads = {}
    for name, p in layer.named_parameters():
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g = g.detach().clone()
        expert = getattr(p, "allreduce", True) is False
        dist.all_reduce(g, group=parallel_state.get_expert_data_parallel_group() if expert
                        else parallel_state.get_data_parallel_group(with_context_parallel=True))
        if isinstance(p, DTensor):
            g = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            g = g.full_tensor() if expert else full_tensor(g, partition_stride.stride_of(p))
        grads[name] = g
    return grads


def run_and_compare(config, padded: bool = False, train: bool = True, seed: int = 0) -> dict:
    """The layer against the reference on this rank's tokens: output, input gradient, every
    parameter's full gradient; returns the reference's logged values and token counts."""
    weights = moe_reference.draw_weights(config, seed=seed)
    layer = build(config, weights)
    layer.train(train)
    x, grad_out, padding = data(config, padded)
    ref, ref_grads = moe_reference.reference_grads(config, weights, x, grad_out, chunks=chunks(), padding=padding)
    x_local = local(x, 1).requires_grad_(True)
    output, bias = layer(x_local, padding_mask=None if padding is None else local(padding, 2))
    assert bias is None
    assert_matches(output, local(ref.output, 1), "output")
    (output * local(grad_out, 1)).sum().backward()
    assert_matches(x_local.grad, local(ref_grads["input"], 1), "input gradient")
    grads = full_grads(layer)
    assert grads.keys() == set(ref_grads) - {"input"}, (sorted(grads), sorted(ref_grads))
    for name, g in grads.items():
        assert_matches(g, ref_grads[name], f"{name} gradient")
    return {"logged": ref.logged, "tokens_per_expert": ref.tokens_per_expert, "layer": layer}
