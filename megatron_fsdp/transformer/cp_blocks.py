"""One block of the ring (cp_ring.py): the attention of a query chunk over one key chunk.

A block returns its rows' output normalized by its own log-sum-exp, and that lse; its backward
takes the merged output O and lse of the whole row (the flash-attention backward: P = exp(S -
lse), dS = P * (dP - rowsum(dO * O))) and returns the block's parts of dQ, dK and dV. Two ways:

- `KernelBlocks`: SDPA's flash kernels per block, which take and return the lse (on the CPU
  `_scaled_dot_product_flash_attention_for_cpu`, on CUDA `_scaled_dot_product_flash_attention`
  for fp16/bf16): no c x c score matrix in memory. GQA K/V heads are repeated per block (the
  ring still sends only the hkv heads), their gradients summed back. Used without dropout (the
  kernels' dropout would not be the per-block masks below). On CUDA the kernel is checked once
  per device against `MathBlocks` before it is trusted (see _cuda_kernel_works).
- `MathBlocks`: plain torch in fp32 (scores materialized per block), with attention dropout:
  block (i, j)'s keep-mask is drawn from a generator seeded by (the call's seed, i, j), so the
  backward draws it again.

Shapes: chunks come in as q [b, hq, c, d] and k, v [b, hkv, c, d] in the inputs' dtype; a
block's output is fp32 [b, hkv, g, c, d] and its lse fp32 [b, hkv, g, c] (query head h = the
K/V head h // g), the layout the ring merges in; dQ is fp32 in that layout, dK and dV fp32
[b, hkv, c, d].
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Optional

import torch

from .._torch_compat import flash_attention_with_lse, flash_attention_with_lse_backward

_CUDA_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_CUDA_KERNEL_OK: dict[int, bool] = {}  # the once-per-device check's verdict, by device index


def blocks_for(q: torch.Tensor, scale: float, dropout_p: float):
    """The block attention of one ring call: the kernels where they apply, else the math."""
    if dropout_p == 0.0 and _kernel_applies(q):
        return KernelBlocks(scale)
    seed = dropout_seed(q.device) if dropout_p > 0 else None
    return MathBlocks(scale, dropout_p, seed)


def _kernel_applies(q: torch.Tensor) -> bool:
    head_dim = q.size(-1)
    if q.device.type == "cpu":
        return q.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if q.device.type == "cuda":
        # NOTE: the flash kernel's own limits: half precision, a head dim of a multiple of 8 up to 256.
        if q.dtype not in _CUDA_KERNEL_DTYPES or head_dim % 8 or head_dim > 256:
            return False
        return _cuda_kernel_works(q.device, q.dtype, head_dim)
    return False


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[b, hq, c, ...] -> fp32 [b, hkv, g, c, ...]."""
    return x.float().unflatten(1, (hkv, x.size(1) // hkv))


# ---- the kernels -----------------------------------------------------------------------------------

class KernelBlocks:
    def __init__(self, scale: float):
        self.scale = scale
        # What a block's forward returned for its backward (CUDA: sequence offsets, RNG state), by (i, j).
        self.saved: dict[tuple[int, int], tuple] = {}

    def forward(self, q, k, v, i: int, j: int, kind: str):
        hkv = k.size(1)
        k, v = _repeat_heads(k, q.size(1)), _repeat_heads(v, q.size(1))
        causal = kind == "diagonal"  # NOTE: equal chunk lengths: top-left causal is the diagonal block's mask
        out, lse, self.saved[(i, j)] = flash_attention_with_lse(q.contiguous(), k, v, causal=causal, scale=self.scale)
        return _grouped(out, hkv), _grouped(lse, hkv)

    def backward(self, q, k, v, out, dout, lse, i: int, j: int, kind: str):
        hkv, hq = k.size(1), q.size(1)
        k, v = _repeat_heads(k, hq), _repeat_heads(v, hq)
        causal = kind == "diagonal"
        lse = lse.flatten(1, 2).contiguous()  # the row's merged lse, [b, hq, c]
        q, out, dout = q.contiguous(), out.contiguous(), dout.contiguous()
        dq, dk, dv = flash_attention_with_lse_backward(dout, q, k, v, out, lse, self.saved[(i, j)],
                                                       causal=causal, scale=self.scale)
        # GQA: a K/V head's gradient sums over the query heads of its group.
        return _grouped(dq, hkv), _grouped(dk, hkv).sum(2), _grouped(dv, hkv).sum(2)


def _repeat_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """K/V [b, hkv, c, d] -> [b, hq, c, d], query head h reading K/V head h // (hq / hkv)."""
    return (x if x.size(1) == hq else x.repeat_interleave(hq // x.size(1), dim=1)).contiguous()


def _cuda_kernel_works(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Once per device: a full and a diagonal block, forward and backward, through the kernel and
    through MathBlocks. A kernel that fails or disagrees leaves the math in place, said once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CUDA_KERNEL_OK:
        _CUDA_KERNEL_OK[index] = _kernel_agrees_with_math(torch.device("cuda", index), dtype, head_dim)
    return _CUDA_KERNEL_OK[index]


def _kernel_agrees_with_math(device, dtype, head_dim) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 64, head_dim, generator=g, device=device, dtype=dtype)
                     for h in (4, 2, 2, 4))
    try:
        for kind in ("full", "diagonal"):
            got, want = KernelBlocks(0.125), MathBlocks(0.125, 0.0, None)
            out, lse = got.forward(q, k, v, 0, 0, kind)
            ref_out, ref_lse = want.forward(q, k, v, 0, 0, kind)
            merged = out.flatten(1, 2).to(dtype)
            grads = got.backward(q, k, v, merged, dout, lse, 0, 0, kind)
            ref_grads = want.backward(q, k, v, merged, dout, ref_lse, 0, 0, kind)
            for a, b in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
                torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)  # gross errors: layouts, masks
        return True
    except Exception as exc:  # noqa: BLE001  (any failure: the math path is always right)
        warnings.warn(f"context-parallel ring: the flash kernel per block failed its check on {device} "
                      f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the ring "
                      f"computes its blocks in plain torch (fp32) instead", stacklevel=2)
        return False


# ---- the math -------------------------------------------------------------------------------------

class MathBlocks:
    def __init__(self, scale: float, dropout_p: float, seed: Optional[int]):
        self.scale, self.p, self.seed = scale, dropout_p, seed

    def forward(self, q, k, v, i: int, j: int, kind: str):
        hkv = k.size(1)
        q = _grouped(q, hkv)
        scores = _scores(q, k.float(), self.scale, kind)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        keep = self._keep(i, j, q)
        if keep is not None:
            probs = probs * keep / (1.0 - self.p)
        return torch.matmul(probs, v.float().unsqueeze(2)), lse

    def backward(self, q, k, v, out, dout, lse, i: int, j: int, kind: str):
        hkv = k.size(1)
        q, out, dout, k, v = _grouped(q, hkv), _grouped(out, hkv), _grouped(dout, hkv), k.float(), v.float()
        # NOTE: delta = rowsum(dO * O) over the full row, O the (dropped-out) output: this is the
        # softmax backward's sum_j P_ij dP_ij, with or without dropout.
        delta = (dout * out).sum(-1)
        probs = torch.exp(_scores(q, k, self.scale, kind) - lse.unsqueeze(-1))  # its share of the full softmax
        dprobs = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
        kept, keep = probs, self._keep(i, j, q)
        if keep is not None:
            kept = probs * keep / (1.0 - self.p)
            dprobs = dprobs * keep / (1.0 - self.p)
        dscores = probs * (dprobs - delta.unsqueeze(-1))
        dq = torch.matmul(dscores, k.unsqueeze(2)) * self.scale
        # GQA: a K/V head's gradient sums over the query heads of its group (dim 2).
        dk = torch.matmul(dscores.transpose(-1, -2), q).sum(2) * self.scale
        dv = torch.matmul(kept.transpose(-1, -2), dout).sum(2)
        return dq, dk, dv

    def _keep(self, i: int, j: int, queries: torch.Tensor) -> Optional[torch.Tensor]:
        """Block (i, j)'s keep-mask [b, hkv, g, c, c], or None without dropout."""
        if self.seed is None:
            return None
        b, hkv, g, c, _ = queries.shape
        return dropout_keep_mask(self.seed, i, j, (b, hkv * g, c, c), self.p, queries.device).view(b, hkv, g, c, c)


def _scores(q, k, scale, kind):
    """q [b, hkv, g, c, d], k [b, hkv, c, d] (fp32) -> scores [b, hkv, g, c, c]."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if kind == "diagonal":
        c = scores.size(-1)
        hidden = torch.ones(c, c, dtype=torch.bool, device=scores.device).triu(1)
        # NOTE: every row keeps its own key, so no row is all -inf (its lse stays finite).
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


# ---- dropout --------------------------------------------------------------------------------------

def dropout_keep_mask(seed: int, q_chunk: int, k_chunk: int, shape, p: float, device) -> torch.Tensor:
    """Block (q_chunk, k_chunk)'s keep-mask [b, hq, c, c] (float, 1 = kept) for a call's `seed`."""
    generator = torch.Generator(device=device).manual_seed(_hash_seed(f"{seed}:{q_chunk}:{k_chunk}".encode()))
    return (torch.rand(shape, generator=generator, device=device) >= p).float()


@torch.compiler.disable  # NOTE: run at every call; traced, the seed would be a constant of the graph
def dropout_seed(device: torch.device) -> int:
    """A call's dropout seed, from the current RNG state of `device`, which it then advances."""
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)  # host-side (seed, offset): no sync
    elif device.type == "cpu":
        state = torch.get_rng_state()
    else:
        raise NotImplementedError(f"ring_attention: dropout on {device.type} tensors is not supported")
    torch.rand(1, device=device)  # the next call gets another seed (asynchronous on CUDA)
    return _hash_seed(state.numpy().tobytes())


def _hash_seed(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
