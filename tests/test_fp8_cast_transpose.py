"""cast_transpose_to_fp8 (csrc/fp8_cast_transpose.cpp, fp8_kernels_cuda.cu) against PyTorch.

One read of a 2-D tensor gives its fp8 bytes row-major and transposed (with
zero columns up to the requested padding) and its amax. Every path must equal
torch's `(x.float() * scale).clamp(-max, max).to(fp8)` bit for bit, in both
layouts, whatever the strides of the input; with a power-of-two scale also
the float64 computation (the product is exact, so nothing rounds twice); the
amax equals `max |x|` computed in float64, NaN for NaN, 0 for no elements.
"""

import pytest
import torch

from megatron_fsdp import kernels
from megatron_fsdp.kernels import fp8_cast
from test_amax_kernel import DTYPES, FP8, _ext, _fp8_inputs, _torch_fp8_bits, requires_cuda

SHAPES = [(1, 1), (3, 5), (33, 65), (64, 17), (130, 70)]
LAYOUTS = ["contiguous", "transposed", "strided"]


def _src(shape, layout, dtype, device="cpu"):
    rows, cols = shape
    values = _fp8_inputs(dtype, device)
    if layout == "contiguous":
        return values[:rows * cols].view(rows, cols)
    if layout == "transposed":  # a column-major view
        return values[:rows * cols].view(cols, rows).t()
    return values[:rows * cols * 2].view(rows, cols * 2)[:, ::2]  # a column stride of 2


def _expected(src, scale, fp8, pad_rows_to):
    rows, cols = src.shape
    out = _torch_fp8_bits(src, scale, fp8)
    padded = -(-rows // pad_rows_to) * pad_rows_to
    out_t = torch.zeros((cols, padded), dtype=torch.uint8, device=src.device)
    out_t[:, :rows] = out.t()
    amax = torch.tensor([float(src.double().abs().max()) if src.numel() else 0.0], dtype=torch.float32)
    return out, out_t, amax.to(src.device)


def _assert_same(got, expected):
    for name, g, e in zip(("out", "out_t", "amax"), got, expected):
        assert g.shape == e.shape, (name, g.shape, e.shape)
        if name == "amax" and e.isnan().any():
            assert g.isnan().all(), g
        else:
            assert torch.equal(g, e), (name, (g != e).nonzero()[:5])


def _run(path, src, scale, fp8, pad_rows_to, monkeypatch):
    if path == "kernel":
        _ext()
    else:
        monkeypatch.setattr(fp8_cast, "extension_serves", lambda device_type: False)
    return kernels.cast_transpose_to_fp8(src, scale, fp8, pad_rows_to=pad_rows_to)


@pytest.mark.parametrize("fp8", list(FP8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["kernel", "fallback"])
def test_both_layouts_and_the_amax_are_torchs(path, dtype, fp8, monkeypatch):
    for i, shape in enumerate(SHAPES):
        layout, pad = LAYOUTS[i % len(LAYOUTS)], (1, 16)[i % 2]
        src = _src(shape, layout, dtype)
        for scale_value in (1.0, 0.37, 1024.0):
            scale = torch.tensor(scale_value)
            got = _run(path, src, scale, fp8, pad, monkeypatch)
            _assert_same(got, _expected(src, scale, fp8, pad))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_of_the_input_reads_the_same(layout):
    _ext()
    src = _src((64, 48), layout, torch.bfloat16)
    got = kernels.cast_transpose_to_fp8(src, torch.tensor(2.0), torch.float8_e4m3fn, pad_rows_to=16)
    _assert_same(got, kernels.cast_transpose_to_fp8(src.contiguous(), torch.tensor(2.0), torch.float8_e4m3fn,
                                                    pad_rows_to=16))


@pytest.mark.parametrize("fp8", list(FP8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_power_of_two_scale_matches_float64(dtype, fp8):
    _ext()
    src = _src((40, 50), "contiguous", dtype)
    for scale_value in (1.0, 2.0 ** -5, 2.0 ** 7):
        out, out_t, _ = kernels.cast_transpose_to_fp8(src, torch.tensor(scale_value), fp8)
        reference = (src.double() * scale_value).clamp(-FP8[fp8], FP8[fp8]).to(fp8).view(torch.uint8)
        assert torch.equal(out, reference) and torch.equal(out_t, reference.t())


def test_many_threads_and_edge_cases():
    _ext()
    torch.manual_seed(0)
    src = torch.randn(1000, 300, dtype=torch.bfloat16) * 30
    scale = torch.tensor(3.0)
    with_threads = kernels.cast_transpose_to_fp8(src, scale, torch.float8_e4m3fn, pad_rows_to=16)
    _assert_same(with_threads, _expected(src, scale, torch.float8_e4m3fn, 16))
    # No elements: amax 0, and the padding columns still zero.
    for shape in ((0, 5), (5, 0), (0, 0)):
        got = kernels.cast_transpose_to_fp8(torch.empty(shape), scale, torch.float8_e5m2, pad_rows_to=16)
        _assert_same(got, _expected(torch.empty(shape), scale, torch.float8_e5m2, 16))
    nan = torch.ones(3, 4)
    nan[1, 2] = float("nan")
    assert kernels.cast_transpose_to_fp8(nan, scale, torch.float8_e4m3fn)[2].isnan().all()


def test_arguments_are_checked_before_any_work():
    _ext()
    src, scale = torch.ones(4, 6), torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"src must be 2-D \[M, K\], got shape \[24\]"):
        kernels.cast_transpose_to_fp8(src.view(-1), scale, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="pad_rows_to must be a positive int, got 0"):
        kernels.cast_transpose_to_fp8(src, scale, torch.float8_e4m3fn, pad_rows_to=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        kernels.cast_transpose_to_fp8(src, scale, torch.bfloat16)
    out, amax = torch.empty(4, 6, dtype=torch.uint8), torch.empty(1)
    narrow = torch.full((6, 3), 9, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"out_t must be a contiguous Byte tensor \[K, Mt\] with K = 6 and "
                                           r"Mt >= M = 4, got Byte of shape \[6, 3\]"):
        torch.ops.megatron_fsdp.cast_transpose_to_fp8(src, scale, torch.float8_e4m3fn, out, narrow, amax)
    assert (narrow == 9).all()  # nothing written
    with pytest.raises(RuntimeError, match="amax must be a one-element Float tensor"):
        torch.ops.megatron_fsdp.cast_transpose_to_fp8(src, scale, torch.float8_e4m3fn, out,
                                                      torch.empty(6, 4, dtype=torch.uint8), torch.empty(2))


def test_meta_tensors_are_checked_and_not_differentiable():
    _ext()
    src = torch.empty(4, 6, device="meta", requires_grad=True)
    out, out_t = torch.empty(4, 6, dtype=torch.uint8, device="meta"), torch.empty(6, 16, dtype=torch.uint8,
                                                                                 device="meta")
    amax = torch.empty(1, device="meta")
    torch.ops.megatron_fsdp.cast_transpose_to_fp8(src, torch.empty(1, device="meta"), torch.float8_e4m3fn, out,
                                                  out_t, amax)
    assert not out.requires_grad and not amax.requires_grad
    with pytest.raises(RuntimeError, match="out_t must be"):
        torch.ops.megatron_fsdp.cast_transpose_to_fp8(src, torch.empty(1, device="meta"), torch.float8_e4m3fn, out,
                                                      out_t[:, :3], amax)


@requires_cuda
@pytest.mark.parametrize("fp8", list(FP8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_kernel_is_torchs(layout, dtype, fp8):
    for shape in SHAPES + [(4096, 40)]:
        src = _src(shape, layout, dtype, "cuda") if shape[0] * shape[1] * 2 <= 20_019 else (
            torch.randn(shape, device="cuda", dtype=dtype) * 100)
        scale = torch.tensor(0.37, device="cuda")
        got = kernels.cast_transpose_to_fp8(src, scale, fp8, pad_rows_to=16)
        _assert_same(got, _expected(src, scale, fp8, 16))
