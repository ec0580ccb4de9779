"""Ring (p2p) context-parallel attention (megatron_fsdp.transformer.cp_ring) against one process's full
causal attention: outputs, dQ/dK/dV, the chunk-pair blocks computed, dropout's masks."""

import pytest
import torch
import torch.nn.functional as F

from helpers import setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.transformer import cp_blocks, cp_ring
from megatron_fsdp.transformer.cp_ring import ring_attention

B, D, C = 2, 8, 3  # batch, head dim, tokens per chunk
SCALE = 0.3
OUT_TOLERANCE = dict(rtol=1e-5, atol=1e-6)
GRAD_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _full_inputs(cp, hq, hkv, seed=0, dtype=torch.float32):
    """Full-sequence q, k, v [b, heads, s, d] and an upstream gradient, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * cp * C
    q, dout = (torch.randn(B, hq, s, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, hkv, s, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, dout


def _positions(cp, rank):
    """Global positions of a CP rank's two chunks, r and 2P-1-r, in its local order."""
    return torch.cat([torch.arange(rank * C, (rank + 1) * C),
                      torch.arange((2 * cp - 1 - rank) * C, (2 * cp - rank) * C)])


def _reference(q, k, v, dout, attend=None):
    """Full attention's output and gradients (autograd); `attend(q, k, v)` replaces causal SDPA."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if attend is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=q.size(1) != k.size(1))
    else:
        out = attend(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _ring(q, k, v, dout, pos, dropout_p=0.0):
    """ring_attention on this rank's chunks, its inputs given in Megatron's [s, b, heads, d] layout
    (non-contiguous views, as DotProductAttention permutes them); output and gradients as [b, heads, 2c, d]."""
    leaves = [t[:, :, pos].permute(2, 0, 1, 3).contiguous().requires_grad_() for t in (q, k, v)]
    views = [t.permute(1, 2, 0, 3) for t in leaves]
    out = ring_attention(*views, parallel_state.get_context_parallel_group(), scale=SCALE, dropout_p=dropout_p)
    out.backward(dout[:, :, pos])
    return out.detach(), *(t.grad.permute(1, 2, 0, 3) for t in leaves)


def _assert_matches(actual, expected, pos):
    names = ("output", "dQ", "dK", "dV")
    for name, a, e in zip(names, actual, expected):
        tolerance = OUT_TOLERANCE if name == "output" else GRAD_TOLERANCE
        torch.testing.assert_close(a, e[:, :, pos], **tolerance, msg=lambda m: f"{name}:\n{m}")


def _case_matches_full_attention(cp, hq, hkv, dtype=torch.float32):
    setup_parallel(1, context_parallel_size=cp)
    rank = parallel_state.get_context_parallel_rank()
    q, k, v, dout = _full_inputs(cp, hq, hkv, dtype=dtype)
    # fp32 runs the flash kernel per block, fp64 the plain-torch blocks
    assert isinstance(cp_blocks.blocks_for(q, SCALE, 0.0), cp_blocks.KernelBlocks) == (dtype == torch.float32)
    pos = _positions(cp, rank)
    with cp_ring.record_blocks() as blocks:
        actual = _ring(q, k, v, dout, pos)
    _assert_matches(actual, _reference(q, k, v, dout), pos)
    return parallel_state.get_data_parallel_rank(), rank, blocks


def _assert_blocks(results, cp):
    """Each CP group computes every block the causal mask needs exactly once per pass, and none it
    hides entirely; every rank the same number (2P + 1)."""
    needed = {(i, j) for i in range(2 * cp) for j in range(i + 1)}
    groups = {}
    for dp_rank, cp_rank, blocks in results:
        groups.setdefault(dp_rank, {})[cp_rank] = blocks
    for ranks in groups.values():
        assert sorted(ranks) == list(range(cp))
        for phase in ("forward", "backward"):
            done = [(i, j, kind) for blocks in ranks.values() for (p, i, j, kind) in blocks if p == phase]
            pairs = [(i, j) for i, j, _ in done]
            assert len(pairs) == len(set(pairs)) and set(pairs) == needed, (phase, sorted(pairs))
            assert all(kind == ("diagonal" if i == j else "full") for i, j, kind in done), done
            per_rank = {r: sum(p == phase for p, *_ in blocks) for r, blocks in ranks.items()}
            assert set(per_rank.values()) == {2 * cp + 1}, (phase, per_rank)


@pytest.mark.parametrize("world,cp,hq,hkv,dtype", [
    (2, 2, 4, 2, torch.float32),  # GQA
    (2, 2, 4, 2, torch.float64),  # the plain-torch blocks
    (2, 2, 4, 4, torch.float32),
    (4, 4, 4, 2, torch.float32),
    (4, 4, 2, 2, torch.float64),
    (4, 2, 4, 1, torch.float32),  # two CP groups: ring neighbours are global ranks 2 and 3 in one of them
])
def test_ring_matches_full_attention(pools, world, cp, hq, hkv, dtype):
    results = pools(world).run(_case_matches_full_attention, cp, hq, hkv, dtype)
    _assert_blocks(results, cp)


ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash kernel needs a GPU (gpu_check.sh)")


@pytest.mark.parametrize("kind", ["full", "diagonal"])
@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=ON_CUDA)])
def test_a_kernel_block_is_the_math_block(kind, device, dtype):
    """KernelBlocks (SDPA's flash kernel, GQA heads repeated) against MathBlocks: a block's output
    and lse, and its gradients given the row's merged output and lse (here: the block's own)."""
    g = torch.Generator().manual_seed(3)
    head_dim = D if device == "cpu" else 64
    q, dout = (torch.randn(2, 4, 40, head_dim, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 40, head_dim, generator=g).to(device, dtype) for _ in range(2))
    if device == "cuda":
        assert isinstance(cp_blocks.blocks_for(q, SCALE, 0.0), cp_blocks.KernelBlocks)  # its check passed
    kernel, math = cp_blocks.KernelBlocks(SCALE), cp_blocks.MathBlocks(SCALE, 0.0, None)
    out, lse = kernel.forward(q, k, v, 3, 1, kind)
    ref_out, ref_lse = math.forward(q, k, v, 3, 1, kind)
    # bf16: the kernel's output and gradients are rounded to bf16 (the math's are fp32)
    out_tolerance = OUT_TOLERANCE if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    grad_tolerance = GRAD_TOLERANCE if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref_out, **out_tolerance)
    torch.testing.assert_close(lse, ref_lse, **out_tolerance)
    merged = out.flatten(1, 2).to(dtype)
    for got, want in zip(kernel.backward(q, k, v, merged, dout, lse, 3, 1, kind),
                         math.backward(q, k, v, merged, dout, lse, 3, 1, kind)):
        torch.testing.assert_close(got, want, **grad_tolerance)


def test_a_kernel_that_disagrees_with_the_math_is_not_used(monkeypatch):
    """The once-per-device check (run on CUDA before the kernel is trusted): it passes for a right
    kernel, and a wrong one (here the CPU kernel with a broken lse) leaves the math, said once."""
    assert cp_blocks._kernel_agrees_with_math(torch.device("cpu"), torch.float32, D)
    forward = cp_blocks.KernelBlocks.forward
    monkeypatch.setattr(cp_blocks.KernelBlocks, "forward",
                        lambda self, *a: (lambda out, lse: (out, lse + 1.0))(*forward(self, *a)))
    with pytest.warns(UserWarning, match="failed its check on cpu .* plain torch"):
        assert not cp_blocks._kernel_agrees_with_math(torch.device("cpu"), torch.float32, D)


def _case_single_rank_group():
    setup_parallel(1, context_parallel_size=1)
    q, k, v, dout = _full_inputs(1, 4, 2, seed=1)
    pos = _positions(1, 0)
    assert pos.tolist() == list(range(2 * C))
    with cp_ring.record_blocks() as blocks:
        actual = _ring(q, k, v, dout, pos)
    _assert_matches(actual, _reference(q, k, v, dout), pos)
    assert blocks == []  # local causal attention, no ring


def test_single_rank_group_is_local_attention(pools):
    pools(2).run(_case_single_rank_group)


def _dropped_attention(seed, cp, p):
    """Causal attention whose probabilities are dropped with ring_attention's per-block keep-masks."""
    def attend(q, k, v):
        s, group = q.size(2), q.size(1) // k.size(1)
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2) * SCALE).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1),
                                                               float("-inf"))
        keep = torch.zeros(B, q.size(1), s, s)
        for i in range(2 * cp):
            for j in range(i + 1):
                keep[:, :, i * C:(i + 1) * C, j * C:(j + 1) * C] = cp_blocks.dropout_keep_mask(
                    seed, i, j, (B, q.size(1), C, C), p, q.device)
        return (scores.softmax(-1) * keep / (1 - p)) @ v
    return attend


def _case_dropout(cp, p):
    setup_parallel(1, context_parallel_size=cp)
    rank = parallel_state.get_context_parallel_rank()
    q, k, v, dout = _full_inputs(cp, 4, 2, seed=2)
    pos = _positions(cp, rank)
    torch.manual_seed(77)
    seed = cp_blocks.dropout_seed(torch.device("cpu"))
    torch.manual_seed(77)  # every CP rank draws the same seed, as Megatron's CP ranks share their RNG state
    first = _ring(q, k, v, dout, pos, dropout_p=p)
    _assert_matches(first, _reference(q, k, v, dout, _dropped_attention(seed, cp, p)), pos)
    second = _ring(q, k, v, dout, pos, dropout_p=p)  # the RNG moved on: other masks
    undropped = _ring(q, k, v, dout, pos)
    assert not torch.allclose(first[0], second[0]) and not torch.allclose(first[0], undropped[0])


def test_dropout_masks_agree_between_forward_and_backward(pools):
    pools(2).run(_case_dropout, 2, 0.3)


@pytest.mark.parametrize("shapes,dropout_p,match", [
    (((2, 4, 6, 8), (2, 3, 6, 8), (2, 3, 6, 8)), 0.0, "multiple of hkv"),
    (((2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)), 0.0, "even"),
    (((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 4, 8)), 0.0, r"k, v \[b, hkv, 2c, d\]"),
    (((2, 4, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8)), 1.0, r"dropout_p must be in \[0, 1\)"),
])
def test_bad_inputs_are_refused_before_any_communication(shapes, dropout_p, match):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        ring_attention(q, k, v, None, scale=1.0, dropout_p=dropout_p)


def _case_compiled_dropout_draws_new_masks_each_call():
    setup_parallel(1, context_parallel_size=2)
    group = parallel_state.get_context_parallel_group()
    q = torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(ring_attention, backend="aot_eager")
    outs = [compiled(q, q, q, group, scale=0.3, dropout_p=0.5) for _ in range(3)]
    return [not torch.equal(outs[0], other) for other in outs[1:]]


@pytest.mark.slow  # a compile
def test_the_ring_compiled_draws_new_dropout_masks_at_every_call(pools):
    """Traced by torch.compile, the call's dropout seed is still drawn at each call (not a constant
    of the graph: the same masks every step)."""
    assert pools(2).run(_case_compiled_dropout_draws_new_masks_each_call) == [[True, True]] * 2
