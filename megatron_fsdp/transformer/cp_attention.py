"""Context-parallel attention: each sequence split over the CP group, Megatron's layout.

The split (Megatron's `get_batch_on_this_cp_rank`, causal load balancing): a sequence of s
tokens is cut into 2P chunks of c = s / (2P) (P the CP group size); CP rank r keeps chunks r
and 2P-1-r, in that order, so every rank holds as many early (cheap) as late (costly) queries
under the causal mask. Tokens, labels, loss mask and positions are split alike, so each rank's
local sequence is 2c tokens whose global positions are [rc, (r+1)c) then [(2P-1-r)c, (2P-r)c).

The attention of the local queries over the whole sequence, by `--cp-comm-type`:
- `all_gather`: K/V of every rank gathered into the whole sequence (their gradients
  reduce-scattered back to their ranks in the backward), each local query chunk attending to the
  keys up to its own end, causal aligned to the bottom right (no mask tensor).
- `a2a` (Ulysses): an all-to-all trades heads for sequence (each rank then holds the whole
  sequence for heads/P of the heads), local causal attention, and an all-to-all back. Needs the
  query heads and K/V groups divisible by P.
- `p2p`: a ring of K/V blocks with log-sum-exp merging, blocks the mask hides skipped
  (cp_ring.py).
- `a2a+p2p` (hierarchical): the CP group of P = A x R ranks is split into a2a groups of A
  neighbours and p2p rings of R ranks A apart (`--hierarchical-context-parallel-sizes A R`).
  The a2a within a group trades heads for its A ranks' chunks, which laid out as below are the
  two chunks (each A chunks long) of a rank of an R-rank ring; the ring then runs over the p2p
  group as `p2p` does, and an all-to-all goes back.
Every function here takes q [b, hq, 2c, d] and k, v [b, hkv, 2c, d] (GQA: hq a multiple of
hkv, only the hkv groups travel) in this rank's layout and returns [b, hq, 2c, d].
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..tensor_parallel.mappings import _all_gather_single, _reduce_scatter_single
from ..utils import chunks_of_rank
from .enums import CP_COMM_TYPES



# ------------------------------------------------------------------ the split

def positions_of_rank(local_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions of a CP rank's `local_len` tokens (its two chunks)."""
    chunk = local_len // 2
    first, second = chunks_of_rank(cp_size, cp_rank)
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                      torch.arange(second * chunk, (second + 1) * chunk, device=device)])


def zigzag_order(cp_size: int) -> list[int]:
    """The chunk order of the ranks' parts laid end to end (rank 0's two, rank 1's, ...)."""
    return [c for rank in range(cp_size) for c in chunks_of_rank(cp_size, rank)]


def _to_natural(t: torch.Tensor, seq_dim: int, cp_size: int) -> torch.Tensor:
    """The ranks' parts laid end to end (zigzag order) -> the sequence in its own order."""
    chunks = t.chunk(2 * cp_size, dim=seq_dim)
    where = {chunk: i for i, chunk in enumerate(zigzag_order(cp_size))}
    return torch.cat([chunks[where[c]] for c in range(2 * cp_size)], dim=seq_dim)


def _to_zigzag(t: torch.Tensor, seq_dim: int, cp_size: int) -> torch.Tensor:
    """The inverse of _to_natural."""
    chunks = t.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[c] for c in zigzag_order(cp_size)], dim=seq_dim)


# ------------------------------------------------------------------ all_gather

class _GatherSequence(torch.autograd.Function):
    """[b, h, 2c, d] of every rank -> the whole sequence [b, h, s, d] in its own order; the
    backward sums every rank's gradient of the whole sequence and keeps this rank's chunks."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        gathered = torch.empty(size * local.size(0), *local.shape[1:], dtype=local.dtype, device=local.device)
        _all_gather_single(gathered, local.contiguous(), group=group)  # the ranks' parts along dim 0
        gathered = gathered.unflatten(0, (size, -1))
        # [P, b, h, 2c, d]: the ranks' parts end to end along the sequence, then in its own order
        return _to_natural(gathered.permute(1, 2, 0, 3, 4).flatten(2, 3), 2, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        # NOTE: every rank's queries contribute to every chunk's K/V: summed over the ranks, each
        # keeping its own chunks (the ranks' parts end to end: rank r's is the r-th slice).
        parts = _to_zigzag(grad, 2, size).unflatten(2, (size, -1)).permute(2, 0, 1, 3, 4).contiguous()
        mine = torch.empty_like(parts[0])
        _reduce_scatter_single(mine, parts.flatten(0, 1), group=ctx.group)
        return mine, None


def all_gather_attention(q, k, v, group, *, scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Each of this rank's two query chunks attends to the keys up to its own end, causal
    aligned to the bottom right: no [2c, s] mask, and a kernel that takes a causal bias."""
    # NOTE: here, not at the top: torch.nn.attention.bias imports torch._dynamo, which start-up must not.
    from torch.nn.attention.bias import causal_lower_right

    size, rank = dist.get_world_size(group), dist.get_rank(group)
    keys, values = _GatherSequence.apply(k, group), _GatherSequence.apply(v, group)
    chunk = q.size(2) // 2
    outputs = []
    for queries, index in zip(q.split(chunk, dim=2), chunks_of_rank(size, rank)):
        end = (index + 1) * chunk
        outputs.append(F.scaled_dot_product_attention(
            queries, keys[:, :, :end], values[:, :, :end], attn_mask=causal_lower_right(chunk, end),
            dropout_p=dropout_p, scale=scale, enable_gqa=q.size(1) != keys.size(1)))
    return torch.cat(outputs, dim=2)


# ------------------------------------------------------------------ a2a (Ulysses)

class _HeadsForSequence(torch.autograd.Function):
    """[b, h, 2c, d] (all heads, this rank's chunks) -> [b, h/P, s, d] (this rank's heads, the
    whole sequence in its own order), and back when `inverse`: one all-to-all each way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, inverse: bool) -> torch.Tensor:
        ctx.group, ctx.inverse = group, inverse
        return _exchange(x, group, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group, not ctx.inverse), None, None


def _exchange(x: torch.Tensor, group, inverse: bool) -> torch.Tensor:
    # NOTE: the A ranks' chunk pairs, gathered, are put in the order (first chunks by rank, then
    # second chunks by rank reversed). When the group is the whole CP group this is the sequence
    # in its own order; when it is an a2a group of a2a+p2p (ranks vA..vA+A-1) these are the
    # chunks vA..vA+A-1 and then 2P-A(v+1)..2P-1-vA: chunks v and 2R-1-v of an R-rank ring.
    size = dist.get_world_size(group)
    b, h, s, d = x.shape
    if not inverse:
        # Send head group j to rank j; receive every rank's chunks of this rank's heads.
        send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        # [P (source rank), b, h/P, 2c, d] -> [b, h/P, P * 2c, d], zigzag -> natural order
        whole = recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)
        return _to_natural(whole, 2, size)
    # [b, h/P, s, d] -> send rank j its chunks of these heads; receive this rank's chunks of all heads.
    zigzag = _to_zigzag(x, 2, size)
    send = zigzag.reshape(b, h, size, s // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # [P (source rank: its head group), b, h/P, 2c, d] -> [b, P * h/P, 2c, d]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, size * h, s // size, d)


def a2a_attention(q, k, v, group, *, scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    size = dist.get_world_size(group)
    if q.size(1) % size or k.size(1) % size:
        raise ValueError(f"--cp-comm-type a2a needs the attention heads ({q.size(1)}) and query groups "
                         f"({k.size(1)}) of a tensor-parallel rank divisible by --context-parallel-size ({size})")
    q, k, v = (_HeadsForSequence.apply(t, group, False) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale,
                                         enable_gqa=q.size(1) != k.size(1))
    return _HeadsForSequence.apply(out, group, True)


# ------------------------------------------------------------------ a2a+p2p (hierarchical)

def a2a_p2p_attention(q, k, v, groups, *, scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """`groups` = [the a2a group (A neighbours), the p2p ring (R ranks A apart)], Megatron's
    get_hierarchical_context_parallel_groups(): Ulysses within the a2a group, a ring across."""
    from .cp_ring import ring_attention

    a2a_group, p2p_group = _two_levels(groups)
    size = dist.get_world_size(a2a_group)
    if q.size(1) % size or k.size(1) % size:
        raise ValueError(f"--cp-comm-type a2a+p2p needs the attention heads ({q.size(1)}) and query groups "
                         f"({k.size(1)}) of a tensor-parallel rank divisible by the a2a size ({size})")
    q, k, v = (_HeadsForSequence.apply(t, a2a_group, False) for t in (q, k, v))
    out = ring_attention(q, k, v, p2p_group, scale=scale, dropout_p=dropout_p)
    return _HeadsForSequence.apply(out, a2a_group, True)


def _two_levels(groups):
    if not isinstance(groups, (list, tuple)) or len(groups) != 2:
        raise ValueError("--cp-comm-type a2a+p2p takes two hierarchical context-parallel groups (a2a, p2p), "
                         f"from --hierarchical-context-parallel-sizes A R; got {groups!r}")
    return groups


# ------------------------------------------------------------------ dispatch

def context_parallel_attention(q, k, v, group, comm_type: str, *, scale: float,
                               dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence (see the module's
    docstring); `group` the CP group (for a2a+p2p: its [a2a, p2p] hierarchical groups),
    `comm_type` Megatron's --cp-comm-type."""
    attention = {"all_gather": all_gather_attention, "a2a": a2a_attention,
                 "a2a+p2p": a2a_p2p_attention}.get(comm_type)
    if attention is not None:
        with dropout_of_this_rank(q.device, _cp_rank(group)) if dropout_p > 0 else contextlib.nullcontext():
            return attention(q, k, v, group, scale=scale, dropout_p=dropout_p)
    if comm_type == "p2p":
        from .cp_ring import ring_attention

        return ring_attention(q, k, v, group, scale=scale, dropout_p=dropout_p)
    raise ValueError(f"cp_comm_type {comm_type!r} is not supported (one of {', '.join(CP_COMM_TYPES)})")


def _cp_rank(group) -> int:
    """This rank's place in the CP group (for hierarchical groups: a2a rank + A x p2p rank)."""
    if isinstance(group, (list, tuple)):
        a2a_group, p2p_group = _two_levels(group)
        return dist.get_rank(a2a_group) + dist.get_world_size(a2a_group) * dist.get_rank(p2p_group)
    return dist.get_rank(group)


@contextlib.contextmanager
def dropout_of_this_rank(device: torch.device, cp_rank: int):
    """Inside, `device`'s generator draws a stream of this CP rank's own, seeded from the current
    one (which every CP rank shares, and which advances alike on each): the CP ranks' attention
    dropout masks differ (a2a: rank r's heads; all_gather: its query chunks), as one process's
    would, and a recompute that restores the RNG state draws them again."""
    from .cp_blocks import dropout_seed

    seed = dropout_seed(device)
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        generator = torch.cuda.default_generators[devices[0]] if devices else torch.default_generator
        generator.manual_seed((seed + 0x9E3779B97F4A7C15 * (cp_rank + 1)) % (1 << 63))
        yield


def comm_type_of_layer(cp_comm_type, layer_number: int) -> Optional[str]:
    """Megatron's cp_comm_type: one value, or a list with one per layer (layer_number from 1)."""
    if isinstance(cp_comm_type, (list, tuple)):
        return cp_comm_type[layer_number - 1]
    return cp_comm_type
