"""Ring ("p2p") context-parallel causal attention: Megatron's `--cp-comm-type p2p`.

Chunk layout. A sequence of s tokens is cut into 2P chunks of c = s / (2P)
tokens (P = the CP group's size); CP rank r keeps chunks r and 2P-1-r, in that
order (Megatron's causal load balancing, `get_batch_on_this_cp_rank`): its
local sequence is 2c tokens whose global positions are [r*c, (r+1)*c) and then
[(2P-1-r)*c, (2P-r)*c).

The ring. Queries stay on their rank; each rank's K/V pair of chunks (only the
hkv K/V heads: GQA query heads are never repeated before sending) travels P-1
hops to the next rank, so at step t rank r holds the chunks of rank r-t (mod
P). The next hop is posted before the current block is computed.

The skip rule. Attention is computed per (query chunk i, key chunk j) block,
with chunk indices in the global sequence: j > i is hidden by the causal mask
entirely and never computed, j == i is the diagonal block (causal mask inside
it), j < i needs no mask. Every rank computes 2P + 1 of the P(2P + 1) needed
blocks: three at step 0, two at each remote step.

The merge. A block gives its rows' partial output, normalized by its own
log-sum-exp lse_b; partials merge as
    lse = logaddexp(lse_a, lse_b),  out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse),
with outputs, running lse and scores in fp32.

Backward (the flash-attention backward, a second ring): with the saved output
O and final lse, a block's probabilities are P = exp(S - lse) and
dS = P * (dP - rowsum(dO * O)). dQ stays local; each K/V pair of chunks travels
the ring again with an fp32 dK/dV accumulator that follows it one step behind
and makes a last hop home.

A block's attention (cp_blocks.py): SDPA's flash kernel per block where it
applies (CPU; CUDA in fp16/bf16), else plain torch in fp32. Dropout
(dropout_p > 0, the plain path): each block's keep-mask is drawn from a
generator seeded by (this call's seed, i, j), the seed drawn from the current
RNG of the inputs' device (so a caller's RNG-tracker fork applies, as in
DotProductAttention); the backward redraws the same masks.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..utils import chunks_of_rank
from .cp_blocks import blocks_for


# Point-to-point tags of the two streams that may be in flight at once (gloo matches on them;
# NCCL ignores tags and matches by order, which is the same on every rank).
_KV_TAG = 1
_GRAD_TAG = 2

# Every block computed, as (phase, query chunk, key chunk, kind), while record_blocks() is active.
_BLOCK_LOG: Optional[list] = None


@contextlib.contextmanager
def record_blocks():
    """Within it, every chunk-pair block this process computes is appended to the yielded list as
    ("forward" | "backward", query chunk, key chunk, "diagonal" | "full"), chunks by global index."""
    global _BLOCK_LOG
    log, saved = [], _BLOCK_LOG
    _BLOCK_LOG = log
    try:
        yield log
    finally:
        _BLOCK_LOG = saved


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, scale: float,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention over the whole sequence of a CP group, for this rank's two chunks.

    q [b, hq, 2c, d], k/v [b, hkv, 2c, d] (hq % hkv == 0) hold this rank's chunks r and 2P-1-r;
    returns their rows of softmax(q k^T * scale + causal mask) v over the full sequence,
    [b, hq, 2c, d] in q's dtype. Differentiable in q, k and v.
    """
    _check_inputs(q, k, v, dropout_p)
    if dist.get_world_size(group) == 1:
        # The local sequence is the whole sequence, in order.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=q.size(1) != k.size(1))
    return _RingAttention.apply(q, k, v, group, scale, dropout_p)


def _check_inputs(q, k, v, dropout_p) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring_attention: q must be [b, hq, 2c, d] and k, v [b, hkv, 2c, d]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, hq, s, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk) or hq % hkv or s % 2:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} must share b, the "
                         f"local length (two equal chunks: even) and d, with hq a multiple of hkv")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"ring_attention: dropout_p must be in [0, 1), got {dropout_p}")


def block_kind(q_chunk: int, k_chunk: int) -> Optional[str]:
    """None when the causal mask hides the block entirely (skip it), else how to mask it."""
    if k_chunk > q_chunk:
        return None
    return "diagonal" if k_chunk == q_chunk else "full"


def _log_block(phase: str, q_chunk: int, k_chunk: int, kind: str) -> None:
    if _BLOCK_LOG is not None:
        _BLOCK_LOG.append((phase, q_chunk, k_chunk, kind))


class _Ring:
    """This rank's neighbours in the CP group: K/V go to `next` and come from `prev`."""

    def __init__(self, group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # NOTE: P2POp takes global ranks; the group's own ranks only index the ring.
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        """The CP rank whose chunks this rank holds at `step`."""
        return (self.rank - step) % self.size

    def shift(self, tensor: torch.Tensor, tag: int) -> "_Transfer":
        """Send `tensor` to the next rank and receive its like from the previous one (asynchronous)."""
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
               dist.P2POp(dist.irecv, received, self.prev, self.group, tag)]
        return _Transfer(dist.batch_isend_irecv(ops), received)


class _Transfer:
    def __init__(self, requests, received):
        self.requests, self.received = requests, received

    def wait(self) -> torch.Tensor:
        # NOTE: the sent tensor must stay unchanged until here.
        for request in self.requests:
            request.wait()
        return self.received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, dropout_p):
        ring = _Ring(group)
        blocks = blocks_for(q, scale, dropout_p)
        out, lse = _forward_ring(ring, q, k, v, blocks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.blocks = ring, blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward_ring(ctx.ring, q, k, v, out, dout, lse, ctx.blocks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


# ---- the two rings -------------------------------------------------------------------------------

def _forward_ring(ring: _Ring, q, k, v, blocks):
    """This rank's output [b, hq, 2c, d] and lse [b, hkv, g, 2c], both fp32."""
    queries = q.chunk(2, dim=2)
    partials = [None, None]  # per local query chunk: (out, lse) merged so far
    kv = torch.stack([k, v])  # NOTE: one message per hop; K/V keep their dtype and hkv heads
    for step in range(ring.size):
        transfer = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else None
        keys, values = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for (slot, i), (k_slot, j), kind in _blocks(ring, step):
            _log_block("forward", i, j, kind)
            block = blocks.forward(queries[slot], keys[k_slot], values[k_slot], i, j, kind)
            partials[slot] = _merge(partials[slot], block)
        if transfer is not None:
            kv = transfer.wait()
    # NOTE: both query chunks meet their diagonal block at step 0, so no partial is None.
    out = torch.cat([p[0] for p in partials], dim=3)
    lse = torch.cat([p[1] for p in partials], dim=3)
    return out.flatten(1, 2), lse


def _backward_ring(ring: _Ring, q, k, v, out, dout, lse, blocks):
    """dQ, dK, dV (fp32) of this rank's chunks."""
    queries, outs, douts = q.chunk(2, dim=2), out.chunk(2, dim=2), dout.chunk(2, dim=2)
    lses = lse.chunk(2, dim=3)
    dq = [None, None]
    kv = torch.stack([k, v])
    pending = None  # the dK/dV accumulator of the chunks this rank holds, coming from the previous rank
    for step in range(ring.size):
        transfer = ring.shift(kv, _KV_TAG) if step < ring.size - 1 else None
        keys, values = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        grads = torch.zeros((2,) + k.shape, dtype=torch.float32, device=k.device)  # this step's dK, dV
        for (slot, i), (k_slot, j), kind in _blocks(ring, step):
            _log_block("backward", i, j, kind)
            dq_b, dk_b, dv_b = blocks.backward(queries[slot], keys[k_slot], values[k_slot], outs[slot],
                                               douts[slot], lses[slot], i, j, kind)
            dq[slot] = dq_b if dq[slot] is None else dq[slot] + dq_b
            grads[0].chunk(2, dim=2)[k_slot].add_(dk_b)
            grads[1].chunk(2, dim=2)[k_slot].add_(dv_b)
        if pending is not None:
            grads += pending.wait()
        # NOTE: the accumulator follows its K/V one step behind; after the last step it goes one
        # more hop, to the rank that owns those chunks (the source of step P-1 is rank r+1).
        pending = ring.shift(grads, _GRAD_TAG)
        if transfer is not None:
            kv = transfer.wait()
    dk, dv = pending.wait()
    # NOTE: both query chunks meet their diagonal block at step 0, so no dq is None.
    return torch.cat(dq, dim=3).flatten(1, 2), dk, dv


def _blocks(ring: _Ring, step: int):
    """((local slot, query chunk), (K/V slot, key chunk), kind) of every block computed at `step`."""
    for slot, i in enumerate(chunks_of_rank(ring.size, ring.rank)):
        for k_slot, j in enumerate(chunks_of_rank(ring.size, ring.source(step))):
            kind = block_kind(i, j)
            if kind is not None:
                yield (slot, i), (k_slot, j), kind


def _merge(partial, block):
    """Two partial outputs of the same rows, each normalized by its lse, as one."""
    if partial is None:
        return block
    (out_a, lse_a), (out_b, lse_b) = partial, block
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1)
    return out, lse
