"""The CUDA copy kernels' plans (csrc/copy_plan.h), bitwise against torch.

Without a GPU the plans run on the host (`_C.*_emulated`: every block and
thread of the device kernel in turn), which tests the tiling, the 16-byte
vector alignment, the zero padding and the casts; with one, the same cases run
the real kernels.
"""

import pytest
import torch

from megatron_fsdp import kernels

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.extension_has_cuda()),
                                   reason="needs a CUDA device and the extension built with CUDA")
TILE = 256 * 4 * 4  # fp32 elements per tile: threads x vectors per thread x vector width

# (source dtype, destination dtype): bit copies of every width, the mixed-precision casts.
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.uint8, torch.uint8),
         (torch.float64, torch.float64), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
         (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


def _ext():
    if not kernels.extension_available():
        pytest.skip(f"extension not built: {kernels.extension_import_error()}")
    return kernels._load_extension()


def _random(g, shape, dtype):
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


def _sizes(g, count):
    # Around the tile size and the vector width, and the empty and 1-element edge cases.
    choices = [0, 1, 2, 3, 5, 7, 8, 15, 17, 255, TILE - 1, TILE, TILE + 3, 2 * TILE + 5]
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
    inputs = [_misaligned(_random(g, (n,), src_dtype), g) for n in _sizes(g, 12)]
    if seed % 3 == 0:
        inputs.append(_random(g, (6, 4), src_dtype).t())  # strided: ATen's copy
    if seed % 4 == 1:
        inputs.append(_random(g, (9,), torch.float16 if src_dtype != torch.float16 else torch.float32))  # 2nd group
    total = sum(t.numel() for t in inputs)
    out = _misaligned(torch.full((total + 5,), 3, dtype=dst_dtype), g)
    expected = out.clone()
    expected[:total] = torch.cat([t.reshape(-1).to(dst_dtype) for t in inputs])
    return (inputs, out.to(device)), expected.to(device), [t.to(device) for t in inputs]


def split_case(seed, device):
    g = torch.Generator().manual_seed(seed)
    dtype = PAIRS[seed % len(PAIRS)][0]
    world = int(torch.randint(1, 9, (1,), generator=g))
    sizes = _sizes(g, 10)
    src = _random(g, (world, sum(sizes)), dtype).to(device)
    outs = [torch.full((world, s), 7, dtype=dtype, device=device) for s in sizes]
    if seed % 3 == 0 and sizes[0] > 0:
        outs[0] = torch.full((sizes[0], world), 7, dtype=dtype, device=device).t()  # strided out
    expected = [o.clone() for o in outs]
    torch.split_with_sizes_copy(src, sizes, dim=1, out=expected)
    return (src, sizes, outs), expected


def chunk_cat_case(seed, device):
    g = torch.Generator().manual_seed(seed)
    src_dtype, dst_dtype = PAIRS[seed % len(PAIRS)]
    world = int(torch.randint(1, 9, (1,), generator=g))
    tensors = []
    for n in _sizes(g, 10):
        inner = int(torch.randint(1, 4, (1,), generator=g))
        tensors.append(_misaligned(_random(g, (n // inner + 1, inner), src_dtype), g))
    if seed % 3 == 0:
        tensors.append(_random(g, (5, 7), src_dtype).t())  # strided gradient
    cols = sum(-(-t.size(0) // world) * (t.numel() // t.size(0)) for t in tensors)
    out = torch.full((world, cols), 5, dtype=dst_dtype)
    expected = torch.empty_like(out)
    torch._chunk_cat([t.to(dst_dtype) for t in tensors], 0, world, out=expected)
    return ([t.to(device) for t in tensors], world, out.to(device)), expected.to(device)


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("seed", range(16))
def test_pack_into_plan_is_bitwise_cat(seed):
    (inputs, out), expected, _ = pack_case(seed, "cpu")
    _ext().pack_into_emulated(inputs, out)
    assert torch.equal(_bits(out), _bits(expected))


@pytest.mark.parametrize("seed", range(8))
def test_split_copy_out_plan_is_bitwise_torch(seed):
    (src, sizes, outs), expected = split_case(seed, "cpu")
    _ext().split_copy_out_emulated(src, sizes, outs)
    assert all(torch.equal(_bits(a.contiguous()), _bits(b.contiguous())) for a, b in zip(outs, expected))


@pytest.mark.parametrize("seed", range(16))
def test_chunk_cat_plan_is_bitwise_torch(seed):
    (tensors, world, out), expected = chunk_cat_case(seed, "cpu")
    _ext().chunk_cat_emulated(tensors, world, out)
    assert torch.equal(_bits(out), _bits(expected))


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
    (inputs, out), expected, cuda_inputs = pack_case(seed, "cuda")
    torch.ops.megatron_fsdp.pack_into(cuda_inputs, out)
    assert torch.equal(_bits(out), _bits(expected))


@requires_cuda
@pytest.mark.parametrize("seed", range(8))
def test_split_copy_out_cuda_is_bitwise_torch(seed):
    (src, sizes, outs), expected = split_case(seed, "cuda")
    torch.ops.megatron_fsdp.split_copy_out(src, sizes, outs)
    assert all(torch.equal(_bits(a.contiguous()), _bits(b.contiguous())) for a, b in zip(outs, expected))


@requires_cuda
@pytest.mark.parametrize("seed", range(16))
def test_chunk_cat_cuda_is_bitwise_torch(seed):
    (tensors, world, out), expected = chunk_cat_case(seed, "cuda")
    torch.ops.megatron_fsdp.chunk_cat(tensors, world, out)
    assert torch.equal(_bits(out), _bits(expected))


@requires_cuda
def test_cuda_kernels_reject_mixed_devices():
    with pytest.raises(RuntimeError, match="is on"):
        kernels.pack_into([torch.ones(3)], torch.zeros(3, device="cuda"))
