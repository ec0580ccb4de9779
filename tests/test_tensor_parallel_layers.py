"""Tensor-parallel layers, mappings and cross entropy, each alone against its
dense single-process equivalent, at TP = 1, 2, 4 on 4 ranks."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from helpers import FP32_TOLERANCE, full_tensor, make_config, setup_parallel, tiered
from megatron_fsdp import parallel_state
from megatron_fsdp.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megatron_fsdp.tensor_parallel import mappings
from megatron_fsdp.transformer.utils import init_method_normal

WORLD = 4
SEED = 1234
S, B = 8, 2  # sequence, batch: activations are [s, b, h]


def _randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _tp() -> tuple[int, int]:
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
    tp, rank = _tp()
    return t.chunk(tp, dim=dim)[rank]


def _assert_param(p: torch.Tensor, placement, full_shape: tuple) -> None:
    """A TP DTensor with `placement` on the TP mesh; a plain tensor at TP=1."""
    tp, _ = _tp()
    if tp == 1:
        assert not isinstance(p, DTensor) and tuple(p.shape) == full_shape
        return
    assert isinstance(p, DTensor), type(p)
    assert p.device_mesh == parallel_state.get_tensor_model_parallel_mesh()
    assert tuple(p.placements) == (placement,), p.placements
    assert tuple(p.shape) == full_shape


def _assert_same_on_tp_ranks(t: torch.Tensor, what: str) -> None:
    group = parallel_state.get_tensor_model_parallel_group()
    t = t.detach().contiguous()
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t, group=group)
    for other in gathered:
        torch.testing.assert_close(other, gathered[0], rtol=0, atol=0,
                                   msg=lambda m: f"{what} differs across TP ranks\n{m}")


def _set_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Overwrite a (possibly DTensor) parameter with the shard of `full` it holds."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            placement = param.placements[0]
            local = full if placement.is_replicate() else _chunk(full, placement.dim)
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    torch.testing.assert_close(full_tensor(param.detach()), full, rtol=0, atol=0)


def _dense_linear(x, w, b, grad_out):
    """Reference: output, and gradients of <F.linear(x, w, b), grad_out>."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    b = None if b is None else b.detach().clone().requires_grad_(True)
    y = F.linear(x, w, b)
    (y * grad_out).sum().backward()
    return y.detach(), x.grad, w.grad, (None if b is None else b.grad)


# ---------------------------------------------------------------- ColumnParallelLinear

IN, OUT = 16, 24


def _column(tp: int, **kwargs) -> ColumnParallelLinear:
    sp = kwargs.pop("sequence_parallel", False)
    return ColumnParallelLinear(IN, OUT, config=make_config(sequence_parallel=sp),
                                init_method=init_method_normal(0.02), **kwargs)


def _case_column(tp: int) -> None:
    setup_parallel(tp, seed=SEED)
    x = _randn(S, B, IN, seed=1)
    gy = _randn(S, B, OUT, seed=2)
    b_full = _randn(OUT, seed=3)

    # Initialization: the full weight is the seed's first N(0, 0.02) draw, whatever the TP size.
    layer = _column(tp, gather_output=True)
    torch.manual_seed(SEED)
    expected_w = torch.empty(OUT, IN).normal_(0.0, 0.02)
    _assert_param(layer.weight, Shard(0), (OUT, IN))
    _assert_param(layer.bias, Shard(0), (OUT,))
    w_full = full_tensor(layer.weight.detach())
    torch.testing.assert_close(w_full, expected_w, rtol=0, atol=0)
    assert torch.count_nonzero(full_tensor(layer.bias.detach())) == 0
    _set_full(layer.bias, b_full)
    ref_y, ref_gx, ref_gw, ref_gb = _dense_linear(x, w_full, b_full, gy)

    # gather_output=True: the full output on every rank.
    xi = x.clone().requires_grad_(True)
    y, out_bias = layer(xi)
    assert out_bias is None and y.shape == (S, B, OUT)
    torch.testing.assert_close(y, ref_y, **FP32_TOLERANCE)
    (y * gy).sum().backward()
    torch.testing.assert_close(xi.grad, ref_gx, **FP32_TOLERANCE)
    _assert_param(layer.weight.grad, Shard(0), (OUT, IN))
    torch.testing.assert_close(full_tensor(layer.weight.grad), ref_gw, **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(layer.bias.grad), ref_gb, **FP32_TOLERANCE)

    # gather_output=False: this rank's chunk of the last dimension; the
    # per-rank losses sum to the dense loss, so the input gradient is the full one.
    layer.zero_grad()
    layer.gather_output = False
    xi = x.clone().requires_grad_(True)
    y, _ = layer(xi)
    assert y.shape == (S, B, OUT // tp)
    torch.testing.assert_close(y, _chunk(ref_y, -1), **FP32_TOLERANCE)
    (y * _chunk(gy, -1)).sum().backward()
    torch.testing.assert_close(xi.grad, ref_gx, **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(layer.weight.grad), ref_gw, **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(layer.bias.grad), ref_gb, **FP32_TOLERANCE)
    # runtime_gather_output overrides the constructor's choice.
    y, _ = layer(x, runtime_gather_output=True)
    torch.testing.assert_close(y, ref_y, **FP32_TOLERANCE)
    # A second backward accumulates into the sharded gradients.
    layer.zero_grad()
    for _ in range(2):
        y, _ = layer(x)
        (y * _chunk(gy, -1)).sum().backward()
    torch.testing.assert_close(full_tensor(layer.weight.grad), 2 * ref_gw, **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(layer.bias.grad), 2 * ref_gb, **FP32_TOLERANCE)

    # disable_grad_reduce: the input gradient stays this rank's partial sum.
    partial = _column(tp, disable_grad_reduce=True)
    _set_full(partial.weight, w_full)
    xi = x.clone().requires_grad_(True)
    y, _ = partial(xi)
    (y * _chunk(gy, -1)).sum().backward()
    torch.testing.assert_close(xi.grad, _chunk(gy, -1) @ _chunk(w_full, 0), **FP32_TOLERANCE)

    # skip_bias_add: bias returned (this rank's chunk), not added.
    skip = _column(tp, skip_bias_add=True)
    _set_full(skip.weight, w_full)
    _set_full(skip.bias, b_full)
    xi = x.clone().requires_grad_(True)
    y, out_bias = skip(xi)
    torch.testing.assert_close(out_bias, _chunk(b_full, 0), rtol=0, atol=0)
    torch.testing.assert_close(y, _chunk(F.linear(x, w_full), -1), **FP32_TOLERANCE)
    ((y + out_bias) * _chunk(gy, -1)).sum().backward()
    torch.testing.assert_close(xi.grad, ref_gx, **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(skip.bias.grad), ref_gb, **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(skip.weight.grad), ref_gw, **FP32_TOLERANCE)

    # bias=False
    nobias = _column(tp, bias=False, gather_output=True)
    assert nobias.bias is None
    y, out_bias = nobias(x)
    assert out_bias is None
    torch.testing.assert_close(y, F.linear(x, full_tensor(nobias.weight.detach())), **FP32_TOLERANCE)

    # skip_weight_param_allocation: the weight comes with forward (a local shard or a TP DTensor).
    ext = _column(tp, skip_weight_param_allocation=True, bias=False)
    assert ext.weight is None and ext.bias is None
    assert [n for n, _ in ext.named_parameters()] == []
    w_local = _chunk(w_full, 0).clone().requires_grad_(True)
    xi = x.clone().requires_grad_(True)
    y, _ = ext(xi, weight=w_local)
    torch.testing.assert_close(y, _chunk(F.linear(x, w_full), -1), **FP32_TOLERANCE)
    (y * _chunk(gy, -1)).sum().backward()
    _, ref_gx_nb, ref_gw_nb, _ = _dense_linear(x, w_full, None, gy)
    torch.testing.assert_close(w_local.grad, _chunk(ref_gw_nb, 0), **FP32_TOLERANCE)
    torch.testing.assert_close(xi.grad, ref_gx_nb, **FP32_TOLERANCE)
    y, _ = ext(x, weight=layer.weight)  # a DTensor parameter of another layer works too
    torch.testing.assert_close(y, _chunk(F.linear(x, w_full), -1), **FP32_TOLERANCE)
    with pytest.raises(ValueError, match="skip_weight_param_allocation=True: pass `weight`"):
        ext(x)
    with pytest.raises(ValueError, match=rf"weight's local shape is \({OUT // tp}, 15\), "
                                         rf"expected \({OUT // tp}, 16\)"):
        ext(x, weight=torch.zeros(OUT // tp, IN - 1))
    if tp > 1:  # the full weight where a shard is expected
        with pytest.raises(ValueError, match=rf"weight's local shape is \({OUT}, {IN}\)"):
            ext(x, weight=w_full)

    # sequence_parallel: input is this rank's chunk of dim 0; output covers the whole sequence.
    sp = _column(tp, sequence_parallel=True)
    _set_full(sp.weight, w_full)
    _set_full(sp.bias, b_full)
    x_local = _chunk(x, 0).clone().requires_grad_(True)
    y, _ = sp(x_local)
    assert y.shape == (S, B, OUT // tp)
    torch.testing.assert_close(y, _chunk(ref_y, -1), **FP32_TOLERANCE)
    (y * _chunk(gy, -1)).sum().backward()
    torch.testing.assert_close(x_local.grad, _chunk(ref_gx, 0), **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(sp.weight.grad), ref_gw, **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(sp.bias.grad), ref_gb, **FP32_TOLERANCE)
    sp.gather_output = True
    y, _ = sp(_chunk(x, 0))
    torch.testing.assert_close(y, ref_y, **FP32_TOLERANCE)

    # Wrong input width.
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: input's last dimension is 15, expected 16"):
        layer(torch.zeros(S, B, IN - 1))


@pytest.mark.parametrize("tp", tiered([1, 2, 4], [1, 4]))  # TP 2: the suite
def test_column_parallel_linear_matches_dense(pools, tp):
    pools(WORLD).run(_case_column, tp)


def _case_column_stride(tp: int) -> None:
    """Megatron's stride 2 (a gated fc1): rank r holds full-weight row slices r and TP + r."""
    from megatron_fsdp.tensor_parallel import partition_stride

    setup_parallel(tp, seed=SEED)
    _, rank = _tp()
    layer = _column(tp, stride=2, gather_output=False)
    torch.manual_seed(SEED)
    full_w = torch.empty(OUT, IN).normal_(0.0, 0.02)  # drawn whole, as with stride 1
    slices = full_w.chunk(2 * tp)
    local = layer.weight.to_local() if isinstance(layer.weight, DTensor) else layer.weight
    torch.testing.assert_close(local.detach(), torch.cat([slices[rank], slices[tp + rank]]), rtol=0, atol=0)
    assert (layer.weight.partition_stride, layer.bias.partition_stride) == (2, 2)
    torch.testing.assert_close(full_tensor(layer.weight.detach(), 2), full_w, rtol=0, atol=0)
    torch.testing.assert_close(partition_stride.full_value(layer.weight.detach(), 2, tp), full_w, rtol=0, atol=0)
    # The output halves are the rank's rows of each half of the dense output ([gate_r; up_r] for fc1).
    x = _randn(S, B, IN, seed=1)
    y, _ = layer(x)
    dense = F.linear(x, full_w)
    gate, up = y.chunk(2, dim=-1)
    torch.testing.assert_close(gate, _chunk(dense[..., :OUT // 2], -1), **FP32_TOLERANCE)
    torch.testing.assert_close(up, _chunk(dense[..., OUT // 2:], -1), **FP32_TOLERANCE)
    # The layout helpers: blocks <-> full, and the full row of each block row.
    blocks = partition_stride.to_blocks(full_w, 2, tp)
    assert torch.equal(partition_stride.from_blocks(blocks, 2, tp), full_w)
    rows = partition_stride.full_rows(torch.arange(OUT), OUT, 2, tp)
    assert torch.equal(full_w[rows], blocks)
    for start, length in ((0, OUT), (5, 7), (OUT - 3, 3)):
        runs = partition_stride.full_row_runs(start, length, OUT, 2, tp)
        assert sum(n for _, _, n in runs) == length
        for offset, first, n in runs:
            assert torch.equal(blocks[start + offset:start + offset + n], full_w[first:first + n])


@pytest.mark.parametrize("tp", tiered([1, 2, 4], [1, 4]))  # TP 2: the suite
def test_column_stride_splits_megatrons_way(pools, tp):
    pools(WORLD).run(_case_column_stride, tp)


# ------------------------------------------------------------------- RowParallelLinear

R_IN, R_OUT = 24, 16


def _row(tp: int, **kwargs) -> RowParallelLinear:
    sp = kwargs.pop("sequence_parallel", False)
    kwargs.setdefault("bias", True)
    kwargs.setdefault("input_is_parallel", True)
    kwargs.setdefault("skip_bias_add", False)
    return RowParallelLinear(R_IN, R_OUT, config=make_config(sequence_parallel=sp),
                             init_method=init_method_normal(0.02), **kwargs)


def _check_row_bias_grad(layer, expected: torch.Tensor) -> None:
    grad = layer.bias.grad
    _assert_param(grad, Replicate(), (R_OUT,))
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    _assert_same_on_tp_ranks(local, "RowParallelLinear bias gradient")
    torch.testing.assert_close(local, expected, **FP32_TOLERANCE)


def _case_row(tp: int) -> None:
    setup_parallel(tp, seed=SEED)
    x = _randn(S, B, R_IN, seed=11)
    gy = _randn(S, B, R_OUT, seed=12)
    b_full = _randn(R_OUT, seed=13)

    layer = _row(tp)
    torch.manual_seed(SEED)
    torch.testing.assert_close(full_tensor(layer.weight.detach()), torch.empty(R_OUT, R_IN).normal_(0.0, 0.02),
                               rtol=0, atol=0)
    _assert_param(layer.weight, Shard(1), (R_OUT, R_IN))
    _assert_param(layer.bias, Replicate(), (R_OUT,))
    _set_full(layer.bias, b_full)
    w_full = full_tensor(layer.weight.detach())
    ref_y, ref_gx, ref_gw, ref_gb = _dense_linear(x, w_full, b_full, gy)

    # input_is_parallel=True: input is this rank's chunk of the last dim; full output.
    x_local = _chunk(x, -1).clone().requires_grad_(True)
    y, out_bias = layer(x_local)
    assert out_bias is None and y.shape == (S, B, R_OUT)
    torch.testing.assert_close(y, ref_y, **FP32_TOLERANCE)
    (y * gy).sum().backward()
    torch.testing.assert_close(x_local.grad, _chunk(ref_gx, -1), **FP32_TOLERANCE)
    _assert_param(layer.weight.grad, Shard(1), (R_OUT, R_IN))
    torch.testing.assert_close(full_tensor(layer.weight.grad), ref_gw, **FP32_TOLERANCE)
    _check_row_bias_grad(layer, ref_gb)

    # input_is_parallel=False: full input, scattered inside.
    full_in = _row(tp, input_is_parallel=False)
    _set_full(full_in.weight, w_full)
    _set_full(full_in.bias, b_full)
    xi = x.clone().requires_grad_(True)
    y, _ = full_in(xi)
    torch.testing.assert_close(y, ref_y, **FP32_TOLERANCE)
    (y * gy).sum().backward()
    torch.testing.assert_close(xi.grad, ref_gx, **FP32_TOLERANCE)
    torch.testing.assert_close(full_tensor(full_in.weight.grad), ref_gw, **FP32_TOLERANCE)
    _check_row_bias_grad(full_in, ref_gb)

    # skip_bias_add: bias returned, not added.
    skip = _row(tp, skip_bias_add=True)
    _set_full(skip.weight, w_full)
    _set_full(skip.bias, b_full)
    y, out_bias = skip(_chunk(x, -1))
    torch.testing.assert_close(out_bias, b_full, rtol=0, atol=0)
    torch.testing.assert_close(y, F.linear(x, w_full), **FP32_TOLERANCE)
    ((y + out_bias) * gy).sum().backward()
    _check_row_bias_grad(skip, ref_gb)

    # bias=False
    nobias = _row(tp, bias=False)
    assert nobias.bias is None
    y, out_bias = nobias(_chunk(x, -1))
    assert out_bias is None
    torch.testing.assert_close(y, F.linear(x, full_tensor(nobias.weight.detach())), **FP32_TOLERANCE)

    # sequence_parallel: output is this rank's chunk of dim 0; the bias gradient
    # must still be the whole sequence's, and identical on every TP rank.
    for skip_bias_add in (False, True):
        sp = _row(tp, sequence_parallel=True, skip_bias_add=skip_bias_add)
        _set_full(sp.weight, w_full)
        _set_full(sp.bias, b_full)
        x_local = _chunk(x, -1).clone().requires_grad_(True)
        y, out_bias = sp(x_local)
        if skip_bias_add:
            y = y + out_bias
        else:
            assert out_bias is None
        assert y.shape == (S // tp, B, R_OUT)
        torch.testing.assert_close(y, _chunk(ref_y, 0), **FP32_TOLERANCE)
        (y * _chunk(gy, 0)).sum().backward()
        torch.testing.assert_close(x_local.grad, _chunk(ref_gx, -1), **FP32_TOLERANCE)
        torch.testing.assert_close(full_tensor(sp.weight.grad), ref_gw, **FP32_TOLERANCE)
        _check_row_bias_grad(sp, ref_gb)

    with pytest.raises(ValueError, match="sequence_parallel requires input_is_parallel=True"):
        _row(tp, sequence_parallel=True, input_is_parallel=False)
    # Wrong input widths.
    with pytest.raises(ValueError, match=rf"RowParallelLinear: input's last dimension is {R_IN // tp + 1}, "
                                         rf"expected {R_IN // tp} "):
        layer(torch.zeros(S, B, R_IN // tp + 1))
    with pytest.raises(ValueError, match=rf"input's last dimension is {R_IN + 1}, expected {R_IN} "):
        full_in(torch.zeros(S, B, R_IN + 1))


@pytest.mark.parametrize("tp", tiered([1, 2, 4], [1, 4]))  # TP 2: the suite
def test_row_parallel_linear_matches_dense(pools, tp):
    pools(WORLD).run(_case_row, tp)


# ------------------------------------------------------------ VocabParallelEmbedding

VOCAB, H = 32, 8


def _case_embedding(tp: int) -> None:
    setup_parallel(tp, seed=SEED)
    g = torch.Generator().manual_seed(21)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    ids[0, :4] = torch.tensor([0, VOCAB - 1, VOCAB // 2 - 1, VOCAB // 2])  # partition edges
    cfg = make_config()

    emb = VocabParallelEmbedding(VOCAB, H, init_method=init_method_normal(0.02), config=cfg)
    _assert_param(emb.weight, Shard(0), (VOCAB, H))
    torch.manual_seed(SEED)
    torch.testing.assert_close(full_tensor(emb.weight.detach()), torch.empty(VOCAB, H).normal_(0.0, 0.02),
                               rtol=0, atol=0)
    w_full = full_tensor(emb.weight.detach())
    _, rank = _tp()
    assert (emb.vocab_start_index, emb.vocab_end_index) == (rank * VOCAB // tp, (rank + 1) * VOCAB // tp)

    w_ref = w_full.clone().requires_grad_(True)
    ref = F.embedding(ids, w_ref)
    gy = _randn(B, S, H, seed=22)
    (ref * gy).sum().backward()

    out = emb(ids)
    assert out.shape == (B, S, H)
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
    (out * gy).sum().backward()
    _assert_param(emb.weight.grad, Shard(0), (VOCAB, H))
    torch.testing.assert_close(full_tensor(emb.weight.grad), w_ref.grad, **FP32_TOLERANCE)

    # reduce_scatter_embeddings: [s/tp, b, h], this rank's chunk of the sequence.
    rs = VocabParallelEmbedding(VOCAB, H, init_method=init_method_normal(0.02), config=cfg,
                                reduce_scatter_embeddings=True)
    _set_full(rs.weight, w_full)
    out = rs(ids)
    assert out.shape == (S // tp, B, H)
    torch.testing.assert_close(out, _chunk(ref.detach().transpose(0, 1), 0), rtol=0, atol=0)
    (out * _chunk(gy.transpose(0, 1), 0)).sum().backward()
    torch.testing.assert_close(full_tensor(rs.weight.grad), w_ref.grad, **FP32_TOLERANCE)

    if tp > 1:
        with pytest.raises(ValueError, match="sequence length must be divisible by the tensor-parallel size"):
            rs(ids[:, :tp + 1])
        with pytest.raises(ValueError, match=rf"vocabulary size 33 is not divisible by the tensor-parallel size {tp}"):
            VocabParallelEmbedding(33, H, init_method=init_method_normal(0.02), config=cfg)


@pytest.mark.parametrize("tp", tiered([1, 2, 4], [1, 4]))  # TP 2: the suite
def test_vocab_parallel_embedding_matches_dense(pools, tp):
    pools(WORLD).run(_case_embedding, tp)


# ------------------------------------------------------------- vocab-parallel CE


def _case_cross_entropy(tp: int) -> None:
    setup_parallel(tp, seed=SEED)
    V = 32
    # Large, spread-out logits: a missing max-subtraction would overflow exp().
    logits = _randn(S, B, V, seed=31, scale=30.0) + 100.0
    g = torch.Generator().manual_seed(32)
    target = torch.randint(0, V, (S, B), generator=g)
    target[0] = torch.tensor([0, V - 1])
    weights = torch.rand(S, B, generator=g)

    for label_smoothing in (0.0, 0.1):
        ref_logits = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits.reshape(-1, V), target.reshape(-1), reduction="none",
                              label_smoothing=label_smoothing).view(S, B)
        (ref * weights).sum().backward()

        local = _chunk(logits, -1).clone()
        before = local.clone()
        local.requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, label_smoothing)
        assert loss.shape == (S, B)
        assert torch.isfinite(loss).all()
        torch.testing.assert_close(loss, ref.detach(), **FP32_TOLERANCE)
        _assert_same_on_tp_ranks(loss, "vocab-parallel cross entropy loss")
        (loss * weights).sum().backward()
        torch.testing.assert_close(local.grad, _chunk(ref_logits.grad, -1), **FP32_TOLERANCE)
        torch.testing.assert_close(local.detach(), before, rtol=0, atol=0)  # logits untouched

    local = _chunk(logits, -1)
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=rf"label_smoothing must be in \[0, 1\), got {bad}"):
            vocab_parallel_cross_entropy(local, target, bad)
    with pytest.raises(ValueError, match=r"does not match target shape \(8, 3\)"):
        vocab_parallel_cross_entropy(local, torch.zeros(S, B + 1, dtype=torch.long))


@pytest.mark.parametrize("tp", tiered([1, 2, 4], [1, 4]))  # TP 2: the suite
def test_vocab_parallel_cross_entropy_matches_dense(pools, tp):
    pools(WORLD).run(_case_cross_entropy, tp)


# --------------------------------------------------------------------- mappings


def _per_rank(shape, tag: int, tp_rank: int) -> torch.Tensor:
    """A tensor that differs between TP ranks and between TP groups (data-parallel rank)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    return _randn(*shape, seed=1000 * tag + 10 * dp_rank + tp_rank)


def _all_ranks(shape, tag: int) -> list[torch.Tensor]:
    tp, _ = _tp()
    return [_per_rank(shape, tag, r) for r in range(tp)]


def _apply(fn, x: torch.Tensor, grad: torch.Tensor, **kwargs):
    x = x.clone().requires_grad_(True)
    y = fn(x, **kwargs)
    y.backward(grad)
    return y.detach(), x.grad


def _case_mappings(tp: int) -> None:
    setup_parallel(tp, seed=SEED)
    _, rank = _tp()
    shape = (4 * 3, 2, 8)  # dims 0 and -1 divisible by 1, 2, 4
    xs, gs = _all_ranks(shape, 1), _all_ranks(shape, 2)
    total_x, total_g = sum(xs), sum(gs)
    x, g = xs[rank], gs[rank]
    exact = dict(rtol=0, atol=0)

    # copy_to: identity forward, all-reduce of the gradient.
    y, gx = _apply(mappings.copy_to_tensor_model_parallel_region, x, g)
    torch.testing.assert_close(y, x, **exact)
    torch.testing.assert_close(gx, total_g, **FP32_TOLERANCE)

    # reduce_from: all-reduce forward, identity backward.
    y, gx = _apply(mappings.reduce_from_tensor_model_parallel_region, x, g)
    torch.testing.assert_close(y, total_x, **FP32_TOLERANCE)
    torch.testing.assert_close(gx, g, **exact)
    x_before = x.clone()
    mappings.reduce_from_tensor_model_parallel_region(x)
    torch.testing.assert_close(x, x_before, **exact)  # the input is not reduced in place

    # scatter_to TP region: keep this rank's chunk of the last dim; all-gather in backward.
    g_small = _all_ranks((shape[0], shape[1], shape[2] // tp), 3)
    y, gx = _apply(mappings.scatter_to_tensor_model_parallel_region, x, g_small[rank])
    torch.testing.assert_close(y, x.chunk(tp, -1)[rank], **exact)
    torch.testing.assert_close(gx, torch.cat(g_small, -1), **exact)

    # gather_from TP region: concatenate along the last dim; split in backward.
    x_small = _all_ranks((shape[0], shape[1], shape[2] // tp), 4)
    y, gx = _apply(mappings.gather_from_tensor_model_parallel_region, x_small[rank], g)
    torch.testing.assert_close(y, torch.cat(x_small, -1), **exact)
    torch.testing.assert_close(gx, g.chunk(tp, -1)[rank], **exact)
    # A non-contiguous input gathers the same values.
    y = mappings.gather_from_tensor_model_parallel_region(x_small[rank].transpose(0, 2))
    torch.testing.assert_close(y, torch.cat([t.transpose(0, 2) for t in x_small], -1), **exact)

    # Sequence-parallel regions split dim 0.
    seq_small = (shape[0] // tp,) + shape[1:]
    g_seq = _all_ranks(seq_small, 5)
    y, gx = _apply(mappings.scatter_to_sequence_parallel_region, x, g_seq[rank])
    torch.testing.assert_close(y, x.chunk(tp, 0)[rank], **exact)
    torch.testing.assert_close(gx, torch.cat(g_seq, 0), **exact)

    x_seq = _all_ranks(seq_small, 6)
    # gather_from SP, tensor_parallel_output_grad=True (default): reduce-scatter in backward.
    y, gx = _apply(mappings.gather_from_sequence_parallel_region, x_seq[rank], g)
    torch.testing.assert_close(y, torch.cat(x_seq, 0), **exact)
    torch.testing.assert_close(gx, total_g.chunk(tp, 0)[rank], **FP32_TOLERANCE)
    # tensor_parallel_output_grad=False: the gradient is only split.
    y, gx = _apply(mappings.gather_from_sequence_parallel_region, x_seq[rank], g,
                   tensor_parallel_output_grad=False)
    torch.testing.assert_close(y, torch.cat(x_seq, 0), **exact)
    torch.testing.assert_close(gx, g.chunk(tp, 0)[rank], **exact)

    # reduce_scatter to SP: sum over ranks, keep this rank's dim-0 chunk; all-gather in backward.
    y, gx = _apply(mappings.reduce_scatter_to_sequence_parallel_region, x, g_seq[rank])
    torch.testing.assert_close(y, total_x.chunk(tp, 0)[rank], **FP32_TOLERANCE)
    torch.testing.assert_close(gx, torch.cat(g_seq, 0), **exact)

    # Partners: each function's backward is its partner's forward (mappings.py's contract).
    m = mappings
    partners = [
        (m.copy_to_tensor_model_parallel_region, m.reduce_from_tensor_model_parallel_region, shape, shape),
        (m.reduce_from_tensor_model_parallel_region, lambda t: t, shape, shape),
        (m.scatter_to_tensor_model_parallel_region, m.gather_from_tensor_model_parallel_region,
         shape, (shape[0], shape[1], shape[2] // tp)),
        (m.gather_from_tensor_model_parallel_region, m.scatter_to_tensor_model_parallel_region,
         (shape[0], shape[1], shape[2] // tp), shape),
        (m.scatter_to_sequence_parallel_region, m.gather_from_sequence_parallel_region, shape, seq_small),
        (m.gather_from_sequence_parallel_region, m.reduce_scatter_to_sequence_parallel_region, seq_small, shape),
        (m.reduce_scatter_to_sequence_parallel_region, m.gather_from_sequence_parallel_region, shape, seq_small),
    ]
    for i, (f, partner, in_shape, out_shape) in enumerate(partners):
        a = _per_rank(in_shape, 10 + i, rank)
        grad = _per_rank(out_shape, 20 + i, rank)
        y, ga = _apply(f, a, grad)
        assert y.shape == out_shape, (f.__name__, y.shape)
        torch.testing.assert_close(ga, partner(grad), rtol=0, atol=0,
                                   msg=lambda msg: f"backward of {f.__name__} is not its partner's forward\n{msg}")

    # Uneven splits are refused.
    if tp > 1:
        with pytest.raises(ValueError, match=rf"cannot split dimension -1 of size 5 evenly over {tp}"):
            mappings.scatter_to_tensor_model_parallel_region(torch.zeros(2, 5))
        with pytest.raises(ValueError, match=rf"cannot split dimension 0 of size 5 evenly over {tp}"):
            mappings.scatter_to_sequence_parallel_region(torch.zeros(5, 2))
        with pytest.raises(ValueError, match=rf"cannot reduce-scatter dimension 0 of size 5 over {tp}"):
            mappings.reduce_scatter_to_sequence_parallel_region(torch.zeros(5, 2))
    # Uneven split sizes (mixture-of-experts dispatch): tests/test_moe_mappings.py.


@pytest.mark.parametrize("tp", tiered([1, 2, 4], [2]))
def test_mappings_forward_and_backward(pools, tp):
    pools(WORLD).run(_case_mappings, tp)


def _mapping_chain(x: torch.Tensor) -> torch.Tensor:
    """Every mapping once, each forward or backward collective feeding the next (x: [s, b, h])."""
    m, rank = mappings, parallel_state.get_tensor_model_parallel_rank()
    a = m.scatter_to_sequence_parallel_region(x * (rank + 1))  # a dim-0 view in eager
    b = m.gather_from_sequence_parallel_region(a.sin())
    c = m.reduce_from_tensor_model_parallel_region(b.cos())
    d = m.copy_to_tensor_model_parallel_region(c) * (rank + 1)
    e = m.reduce_scatter_to_sequence_parallel_region(d.sin())
    f = m.gather_from_tensor_model_parallel_region(e * (rank + 2))
    h = m.scatter_to_tensor_model_parallel_region(f.cos())
    return m.gather_from_sequence_parallel_region(h * (rank + 1), tensor_parallel_output_grad=False)


def _case_mappings_compiled() -> None:
    setup_parallel(2)
    rank = parallel_state.get_tensor_model_parallel_rank()
    results = []
    # aot_eager: dynamo and AOT autograd trace the mappings as inductor would (the bugs below lived
    # in that tracing), without inductor's code generation, which costs seconds and adds nothing
    # here: the traced graph then runs the same ops as eager, so values must agree exactly.
    for fn in (_mapping_chain, torch.compile(_mapping_chain, backend="aot_eager")):
        x = _randn(S, B, 8, seed=31).requires_grad_()
        y = fn(x)
        (y * _per_rank(tuple(y.shape), 32, rank)).sum().backward()
        results.append((y.detach(), x.grad))
    (y_eager, g_eager), (y_compiled, g_compiled) = results
    assert g_eager.abs().sum() > 0
    torch.testing.assert_close(y_compiled, y_eager, rtol=0, atol=0)
    torch.testing.assert_close(g_compiled, g_eager, rtol=0, atol=0)


@pytest.mark.slow  # one trace on 2 cores
def test_compiled_mappings_give_eagers_values_and_gradients(pools):
    # torch 2.11 traced the in-place c10d collectives inside the mappings, and a mapping that
    # returns a view of its input, with zero gradients: --torch-compile with TP trained wrongly
    # (mappings.py uses functional collectives and fresh tensors while compiling).
    pools(2).run(_case_mappings_compiled)


# ------------------------------------------------------------ constructor errors


def _case_unsupported_options() -> None:
    setup_parallel(2)
    cfg = make_config()
    init = init_method_normal(0.02)
    for option, value in (("stride", 2), ("is_expert", True), ("keep_master_weight_for_test", True)):
        if option != "stride":  # ColumnParallelLinear's stride: test_column_stride_splits_megatrons_way
            with pytest.raises(NotImplementedError,
                               match=rf"ColumnParallelLinear: {option}={value!r} is not supported"):
                ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, **{option: value})
        with pytest.raises(NotImplementedError, match=rf"RowParallelLinear: {option}={value!r} is not supported"):
            RowParallelLinear(R_IN, R_OUT, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                              skip_bias_add=False, **{option: value})
    with pytest.raises(ValueError, match="ColumnParallelLinear: stride must be a positive integer, got 0"):
        ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, stride=0)
    with pytest.raises(ValueError, match="output_size 24 is not divisible by stride 8 x the tensor-parallel size 2"):
        ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, stride=8)
    with pytest.raises(NotImplementedError, match="embedding_activation_buffer"):
        ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, embedding_activation_buffer=[])
    # A foreign process group is refused rather than silently ignored.
    world = dist.group.WORLD
    with pytest.raises(ValueError, match="tp_group must be None"):
        ColumnParallelLinear(IN, OUT, config=cfg, init_method=init, tp_group=world)
    with pytest.raises(ValueError, match="tp_group must be None"):
        RowParallelLinear(R_IN, R_OUT, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                          skip_bias_add=False, tp_group=world)
    with pytest.raises(ValueError, match="tp_group must be None"):
        VocabParallelEmbedding(VOCAB, H, init_method=init, config=cfg, tp_group=world)
    # The TP group itself is accepted.
    ColumnParallelLinear(IN, OUT, config=cfg, init_method=init,
                         tp_group=parallel_state.get_tensor_model_parallel_group())
    # Sizes the TP size does not divide.
    with pytest.raises(ValueError, match="25 is not divisible by 2"):
        ColumnParallelLinear(IN, 25, config=cfg, init_method=init)
    with pytest.raises(ValueError, match="25 is not divisible by 2"):
        RowParallelLinear(25, R_OUT, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                          skip_bias_add=False)


@pytest.mark.slow  # a pool case at TP 2
def test_unsupported_constructor_options_raise(pools):
    pools(WORLD).run(_case_unsupported_options)



def _case_reset_parameters() -> None:
    # Each layer's own reset_parameters() draws its values again as its build did.
    from megatron_fsdp.transformer.norms import LayerNorm

    setup_parallel(2)
    cfg = make_config(add_bias_linear=True)
    builds = {
        "column": lambda: ColumnParallelLinear(32, 48, config=cfg, init_method=init_method_normal(0.02), bias=True),
        "row": lambda: RowParallelLinear(48, 32, config=cfg, init_method=init_method_normal(0.02), bias=True,
                                         skip_bias_add=False, input_is_parallel=True),
        "embedding": lambda: VocabParallelEmbedding(64, 32, init_method=init_method_normal(0.02), config=cfg),
        "norm": lambda: LayerNorm(cfg, 32),
    }
    for name, build in builds.items():
        torch.manual_seed(5)
        layer = build()
        built = {k: full_tensor(v).clone() for k, v in layer.named_parameters()}
        with torch.no_grad():
            for p in layer.parameters():
                p.to_local().fill_(7.0) if isinstance(p, DTensor) else p.fill_(7.0)
        torch.manual_seed(5)
        layer.reset_parameters()
        for k, v in layer.named_parameters():
            assert torch.equal(full_tensor(v), built[k]), f"{name}.{k}"


def test_each_layer_resets_its_own_parameters(pools):
    pools(2).run(_case_reset_parameters)
