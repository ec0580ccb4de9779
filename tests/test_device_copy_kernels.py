"""The CUDA copy kernels' plans (csrc/copy_plan.h), bitwise against torch.

Without a GPU the plans run on the host (`_C.*_emulated`: every block and
thread of the device kernel in turn, through the same copy_tile() code and the
same ATen fallback copies), which tests the tiling, the 16-byte vector
alignment, the zero padding, the casts and the addressing of every output
layout; with one, the same cases run the real kernels.

The references are computed on the CPU, never by a CUDA op. On the first GPU
run three copy-out cases failed (transposed first output) while their host
emulation passed, which looked like device addressing the emulation did not
model. It was the reference: the test built it with torch's CUDA
`split_with_sizes_copy(out=[o.clone() ...])`; `clone()` keeps a transposed
output's column-major strides, and torch's CUDA op takes a fast path for every
output that is non-overlapping and dense (a transposed one is), writing the
elements as if the output were contiguous (aten/src/ATen/native/cuda/
TensorShape.cu, `split_with_sizes_copy_out_cuda`; torch 2.4-2.14). The
emulation was right to pass; a plan that addresses such rows as contiguous
fails the host tests below (checked by making the planner do so). Our plan sends an output
whose rows are not unit-stride to ATen's strided `copy_`, on the host as on
the device, and `test_split_copy_out_layouts_*` below pin every layout.
"""

import pytest
import torch

from megatron_fsdp import kernels

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.extension_has_cuda()),
                                   reason="needs a CUDA device and the extension built with CUDA")

# (source dtype, destination dtype): bit copies of every width, the mixed-precision casts.
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.uint8, torch.uint8),
         (torch.float64, torch.float64), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
         (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


def _ext():
    if not kernels.extension_available():
        pytest.skip(f"extension not built: {kernels.extension_import_error()}")
    return kernels._load_extension()


# NaN, infinities, signed zeros, a subnormal, a bf16 rounding tie (1 + 2^-8),
# a value past fp16's range: where casts differ most easily.
SPECIAL = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-40, 1.00390625, 70000.0]


def _random(g, shape, dtype):
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    t = torch.randn(shape, generator=g)
    flat = t.view(-1)
    picks = torch.randint(0, len(SPECIAL), (flat.numel(),), generator=g)
    mask = torch.rand(flat.numel(), generator=g) < 0.1
    flat[mask] = torch.tensor(SPECIAL)[picks[mask]]
    return t.to(dtype)


def _tile(src_dtype, dst_dtype):
    """Elements per tile of the kernel for this dtype pair (copy_plan.h)."""
    widest = max(src_dtype.itemsize, dst_dtype.itemsize)
    return 256 * 4 * (16 // widest)


def _sizes(g, count, pair):
    # Around this pair's tile size and vector width, and the empty and 1-element edge cases.
    tile = _tile(*pair)
    choices = [0, 1, 2, 3, 5, 7, 8, 15, 17, 255, tile - 1, tile, tile + 3, 2 * tile + 5]
    return [choices[int(i)] for i in torch.randint(0, len(choices), (count,), generator=g)]


def _misaligned(t, g):
    """The same values at a storage offset of 0-3 elements."""
    shift = int(torch.randint(0, 4, (1,), generator=g))
    storage = torch.empty(t.numel() + shift, dtype=t.dtype, device=t.device)
    view = storage[shift:].view(t.shape)
    view.copy_(t)
    return view


def pack_case(seed, device):
    g = torch.Generator().manual_seed(seed)
    src_dtype, dst_dtype = PAIRS[seed % len(PAIRS)]
    inputs = [_misaligned(_random(g, (n,), src_dtype), g) for n in _sizes(g, 12, (src_dtype, dst_dtype))]
    if seed % 3 == 0:
        inputs.append(_random(g, (6, 4), src_dtype).t())  # strided: ATen's copy
    if seed % 4 == 1:
        inputs.append(_random(g, (9,), torch.float16 if src_dtype != torch.float16 else torch.float32))  # 2nd group
    inputs = [t.to(device) for t in inputs]
    total = sum(t.numel() for t in inputs)
    out = _misaligned(torch.full((total + 5,), 3, dtype=dst_dtype, device=device), g)
    expected = out.clone()  # torch's casts on the same device
    expected[:total] = torch.cat([t.reshape(-1).to(dst_dtype) for t in inputs])
    return (inputs, out), expected


def split_case(seed, device):
    g = torch.Generator().manual_seed(seed)
    dtype = PAIRS[seed % len(PAIRS)][0]
    world = int(torch.randint(1, 9, (1,), generator=g))
    sizes = _sizes(g, 10, (dtype, dtype))
    src = _random(g, (world, sum(sizes)), dtype).to(device)
    outs = [torch.full((world, s), 7, dtype=dtype, device=device) for s in sizes]
    if seed % 3 == 0 and sizes[0] > 0:
        outs[0] = torch.full((sizes[0], world), 7, dtype=dtype, device=device).t()  # strided out
    # Rows further apart than their length (a pitched 2-D output).
    outs[1] = torch.full((world, sizes[1] + 3), 7, dtype=dtype, device=device)[:, :sizes[1]]
    return (src, sizes, outs), _split_reference(src, sizes, outs)


def _split_reference(src, sizes, outs):
    """What each output must hold afterwards, computed on the CPU element by element
    (strided copy_): not by a CUDA op, see the module docstring."""
    expected, offset = [], 0
    for out, size in zip(outs, sizes):
        want = out.cpu().clone()
        want.copy_(src.cpu()[:, offset:offset + size])
        expected.append(want)
        offset += size
    return expected


def chunk_cat_case(seed, device):
    g = torch.Generator().manual_seed(seed)
    src_dtype, dst_dtype = PAIRS[seed % len(PAIRS)]
    world = int(torch.randint(1, 9, (1,), generator=g))
    tensors = []
    for n in _sizes(g, 10, (src_dtype, dst_dtype)):
        inner = int(torch.randint(1, 4, (1,), generator=g))
        tensors.append(_misaligned(_random(g, (n // inner + 1, inner), src_dtype), g))
    if seed % 3 == 0:
        tensors.append(_random(g, (5, 7), src_dtype).t())  # strided gradient
    tensors = [t.to(device) for t in tensors]
    cols = sum(-(-t.size(0) // world) * (t.numel() // t.size(0)) for t in tensors)
    out = torch.full((world, cols), 5, dtype=dst_dtype, device=device)
    expected = torch.empty_like(out)  # torch's casts on the same device
    torch._chunk_cat([t.to(dst_dtype) for t in tensors], 0, world, out=expected)
    return (tensors, world, out), expected


def _bits(t):
    # reshape: a "contiguous" tensor may keep any stride on a size-1 dim, which view() refuses.
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got, expected):
    """Bitwise, but on CPU a NaN may carry another payload: torch's vectorized
    CPU cast writes NaN as 0xFFFF, c10's scalar conversion (the device
    kernel's, emulated here) as 0x7FC0. Both are NaN; on a GPU both sides
    run the same instruction and the bits must match exactly. A reference
    computed on the CPU for a device result is moved there (bit copies only)."""
    expected = expected.to(got.device)
    if got.device.type == "cpu" and got.is_floating_point():
        both_nan = torch.isnan(got) & torch.isnan(expected)
        got, expected = got.clone(), expected.clone()
        got[both_nan] = 0
        expected[both_nan] = 0
    assert torch.equal(_bits(got), _bits(expected))


@pytest.mark.parametrize("seed", range(16))
def test_pack_into_plan_is_bitwise_cat(seed):
    (inputs, out), expected = pack_case(seed, "cpu")
    _ext().pack_into_emulated(inputs, out)
    _assert_same(out, expected)


@pytest.mark.parametrize("seed", range(8))
def test_split_copy_out_plan_is_bitwise_torch(seed):
    (src, sizes, outs), expected = split_case(seed, "cpu")
    _ext().split_copy_out_emulated(src, sizes, outs)
    for got, want in zip(outs, expected):
        _assert_same(got, want)


@pytest.mark.parametrize("seed", range(16))
def test_chunk_cat_plan_is_bitwise_torch(seed):
    (tensors, world, out), expected = chunk_cat_case(seed, "cpu")
    _ext().chunk_cat_emulated(tensors, world, out)
    _assert_same(out, expected)


# Every output layout FSDP2 could hand the copy-out, as (name, make(world, size, dtype, device)):
# each returns the output view, backed by a buffer prefilled with 7 around it.
def _in_buffer(rows, cols, device, dtype, shift=0):
    buffer = torch.full((rows * cols + shift + 5,), 7, dtype=dtype, device=device)
    return buffer[shift:shift + rows * cols].view(rows, cols)


SPLIT_LAYOUTS = {
    "contiguous": lambda w, n, dt, dev: _in_buffer(w, n, dev, dt),
    "transposed": lambda w, n, dt, dev: _in_buffer(n, w, dev, dt).t(),
    "pitched": lambda w, n, dt, dev: _in_buffer(w, n + 3, dev, dt)[:, :n],
    "offset_misaligned": lambda w, n, dt, dev: _in_buffer(w, n, dev, dt, shift=1),
    "column_of_wider_matrix": lambda w, n, dt, dev: _in_buffer(w, n + 9, dev, dt)[:, 4:4 + n],
    "transposed_then_offset": lambda w, n, dt, dev: _in_buffer(n + 2, w, dev, dt)[1:1 + n].t(),
}


def _layout_case(layout, world, size, dtype, device):
    g = torch.Generator().manual_seed(world * 1000 + size)
    sizes = [size, 3, size]
    src = _random(g, (world, sum(sizes)), dtype).to(device)
    outs = [SPLIT_LAYOUTS[layout](world, size, dtype, device), _in_buffer(world, 3, device, dtype),
            SPLIT_LAYOUTS[layout](world, size, dtype, device)]
    bases = [o._base for o in outs]  # the 1-D buffers (views keep their root as _base)
    return src, sizes, outs, bases, _split_reference(src, sizes, outs)


def _outside(out, base):
    """The elements of `base` (the 1-D buffer under `out`) that `out` does not cover."""
    covered = torch.zeros(base.numel(), dtype=torch.bool)
    torch.as_strided(covered, out.shape, out.stride(), out.storage_offset() - base.storage_offset()).fill_(True)
    return base.cpu()[~covered]


def _check_layout(outs, bases, expected):
    for got, want in zip(outs, expected):
        _assert_same(got.cpu(), want)
    for out, base in zip(outs, bases):  # nothing written around the outputs
        outside = _outside(out, base)
        assert torch.equal(outside.view(torch.uint8), torch.full_like(outside, 7).view(torch.uint8))


LAYOUT_SHAPES = [(1, 5), (3, 1), (4, 37), (8, 4096 + 3)]


@pytest.mark.parametrize("layout", sorted(SPLIT_LAYOUTS))
@pytest.mark.parametrize("world, size", LAYOUT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_split_copy_out_layouts_emulated(layout, world, size, dtype):
    src, sizes, outs, bases, expected = _layout_case(layout, world, size, dtype, "cpu")
    _ext().split_copy_out_emulated(src, sizes, outs)
    _check_layout(outs, bases, expected)


def test_plans_check_arguments_before_writing():
    ext = _ext()
    out = torch.zeros(10)
    with pytest.raises(RuntimeError, match="inputs hold 11 elements but out has only 10"):
        ext.pack_into_emulated([torch.ones(5), torch.ones(6)], out)
    grads, cc_out = [torch.ones(5), torch.ones(3, 2)], torch.zeros(4, 7)
    with pytest.raises(RuntimeError, match="chunk_cat: the padded chunks hold 4 elements per row but out has 7"):
        ext.chunk_cat_emulated(grads, 4, cc_out)
    assert torch.count_nonzero(out) == 0 and torch.count_nonzero(cc_out) == 0


@requires_cuda
@pytest.mark.parametrize("seed", range(16))
def test_pack_into_cuda_is_bitwise_cat(seed):
    (inputs, out), expected = pack_case(seed, "cuda")
    torch.ops.megatron_fsdp.pack_into(inputs, out)
    _assert_same(out, expected)


@requires_cuda
@pytest.mark.parametrize("seed", range(8))
def test_split_copy_out_cuda_is_bitwise_torch(seed):
    (src, sizes, outs), expected = split_case(seed, "cuda")
    torch.ops.megatron_fsdp.split_copy_out(src, sizes, outs)
    for got, want in zip(outs, expected):
        _assert_same(got, want)


@requires_cuda
@pytest.mark.parametrize("seed", range(16))
def test_chunk_cat_cuda_is_bitwise_torch(seed):
    (tensors, world, out), expected = chunk_cat_case(seed, "cuda")
    torch.ops.megatron_fsdp.chunk_cat(tensors, world, out)
    _assert_same(out, expected)


@requires_cuda
@pytest.mark.parametrize("layout", sorted(SPLIT_LAYOUTS))
@pytest.mark.parametrize("world, size", LAYOUT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_split_copy_out_layouts_cuda(layout, world, size, dtype):
    src, sizes, outs, bases, expected = _layout_case(layout, world, size, dtype, "cuda")
    torch.ops.megatron_fsdp.split_copy_out(src, sizes, outs)
    torch.cuda.synchronize()
    _check_layout(outs, bases, expected)


@requires_cuda
def test_cuda_kernels_reject_mixed_devices():
    with pytest.raises(RuntimeError, match="is on"):
        kernels.pack_into([torch.ones(3)], torch.zeros(3, device="cuda"))


@requires_cuda
def test_cuda_kernels_under_graph_capture_use_atens_copies():
    # A captured upload would replay a reused host buffer: capture falls back to ATen.
    inputs = [torch.randn(n, device="cuda") for n in (5, 4096, 37)]
    out = torch.zeros(sum(t.numel() for t in inputs), device="cuda")
    torch.ops.megatron_fsdp.pack_into(inputs, out)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.megatron_fsdp.pack_into(inputs, out)
    for t in inputs:
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.cat(inputs))


@requires_cuda
def test_cuda_kernels_order_on_a_busy_side_stream():
    # The plan's upload and its kernel queue behind pending work on the caller's
    # stream; the host buffers of many back-to-back calls must not be reused early.
    stream = torch.cuda.Stream()
    cases = [pack_case(seed, "cuda") for seed in range(8)]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
        for (inputs, out), _ in cases:
            torch.ops.megatron_fsdp.pack_into(inputs, out)
    stream.synchronize()
    for (_, out), expected in cases:
        _assert_same(out, expected)


# Large copies (over 1 MiB a row) beside small ones, bit copies and casts, whole and padded chunks,
# odd offsets and an output whose rows are further apart than their length: one case per op. (Bit
# copies of 1 MiB or more once went to the copy engine, cudaMemcpyAsync and cudaMemcpy2DAsync: on
# an H100, 2026-11-27, chunk_cat of 20 x 16 MiB gradients then took 3.9x a device memcpy's time,
# against 1.3x for the kernel alone on an H200; benchmarks/bench_copy_in.py.)
BIG = (1 << 20) // 4 + 3  # fp32 elements: just over 1 MiB


def large_cases(device):
    g = torch.Generator().manual_seed(7)
    inputs = [_random(g, (5,), torch.float32), _random(g, (BIG,), torch.float32), _random(g, (300,), torch.float32),
              _misaligned(_random(g, (BIG + 1,), torch.float32), g)]
    inputs = [t.to(device) for t in inputs]
    total = sum(t.numel() for t in inputs)
    pack = []
    for dtype in (torch.float32, torch.bfloat16):  # bits, a cast
        out = torch.full((total + 3,), 3, dtype=dtype, device=device)[1:]
        expected = out.cpu().clone()
        expected[:total] = torch.cat([t.cpu().to(dtype) for t in inputs])
        pack.append(((inputs, out), expected))
    world, sizes = 3, [5, BIG, 7, BIG + 2]
    src = _random(g, (world, sum(sizes)), torch.float32).to(device)
    outs = [torch.full((world, s), 7.0, device=device) for s in sizes]
    outs[3] = torch.full((world, sizes[3] + 9), 7.0, device=device)[:, 4:4 + sizes[3]]  # pitched rows
    split = ((src, sizes, outs), _split_reference(src, sizes, outs))
    grads = [_random(g, (world * 4 * (BIG // 4 + 1),), torch.float32),  # whole chunks
             _random(g, (3 * BIG + 1,), torch.float32),  # padded chunks
             _random(g, (11,), torch.float32)]
    grads = [t.to(device) for t in grads]
    cols = sum(-(-t.size(0) // world) for t in grads)
    cat_out = torch.full((world, cols), 5.0, device=device)
    cat_expected = torch.empty(world, cols)
    torch._chunk_cat([t.cpu() for t in grads], 0, world, out=cat_expected)
    return pack, split, ((grads, world, cat_out), cat_expected)


def _check_large(pack_into, split_copy_out, chunk_cat, device):
    pack, (split_args, split_expected), (cat_args, cat_expected) = large_cases(device)
    for (inputs, out), expected in pack:
        pack_into(inputs, out)
        _assert_same(out.cpu(), expected)
    src, sizes, outs = split_args
    bases = [o.cpu().clone() for o in outs]
    split_copy_out(src, sizes, outs)
    for got, want in zip(outs, split_expected):
        _assert_same(got.cpu(), want)
    wide = outs[3]._base  # the pitched output's buffer: nothing outside its view written
    assert torch.equal(wide[:, :4].cpu(), torch.full((3, 4), 7.0)) and torch.equal(wide[:, -5:].cpu(), torch.full((3, 5), 7.0))
    assert all(b.shape == o.shape for b, o in zip(bases, outs))
    chunk_cat(*cat_args)
    _assert_same(cat_args[2].cpu(), cat_expected)


def test_large_copies_emulated():
    ext = _ext()
    _check_large(ext.pack_into_emulated, ext.split_copy_out_emulated, ext.chunk_cat_emulated, "cpu")


@requires_cuda
def test_large_copies_cuda():
    ops = torch.ops.megatron_fsdp
    _check_large(lambda *a: ops.pack_into(*a), lambda *a: ops.split_copy_out(*a), lambda *a: ops.chunk_cat(*a),
                 "cuda")
    torch.cuda.synchronize()
