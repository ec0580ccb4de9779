"""multi_tensor_amax and cast_to_fp8 (csrc/fp8_kernels*) against PyTorch.

The max of absolute values is exact whatever the order of evaluation, so
every path (CPU kernel, the CUDA kernel's plan run on the host, the CUDA
kernel, the fallback) must equal `t.abs().amax().float()` bit for bit, NaN
for NaN. The fp8 cast must equal torch's `(x.float() * scale).clamp(-max,
max).to(fp8)` bit for bit.
"""

import pytest
import torch

from megatron_fsdp import kernels
from megatron_fsdp.kernels import amax, fp8_cast

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and kernels.extension_has_cuda()),
                                   reason="needs a CUDA device and the extension built with CUDA")


def _ext():
    if not kernels.extension_available():
        pytest.skip(f"extension not built: {kernels.extension_import_error()}")
    return kernels._load_extension()


def _expected(tensors):
    # Written out independently of the module's fallback.
    return torch.tensor([float(t.double().abs().max()) if t.numel() else 0.0 for t in tensors], dtype=torch.float32)


def _same(got, expected):
    assert got.dtype == torch.float32 and got.shape == expected.shape, (got.dtype, got.shape)
    got, expected = got.cpu(), expected.cpu()
    assert torch.equal(got.isnan(), expected.isnan()), (got, expected)
    ok = ~expected.isnan()
    assert torch.equal(got[ok].view(torch.int32), expected[ok].view(torch.int32)), (got, expected)


# A tile of the device kernel holds 256 threads x 8 vectors of 16 bytes.
def _tile(dtype):
    return 256 * 8 * (16 // dtype.itemsize)


def _tensors(seed, device="cpu", count=40):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        dtype = DTYPES[(seed + i) % len(DTYPES)] if seed % 2 else DTYPES[seed // 2 % len(DTYPES)]
        tile = _tile(dtype)
        n = [0, 1, 3, 7, 8, 9, 100, tile - 1, tile, tile + 5, 3 * tile + 11, 70_000][int(torch.randint(0, 12, (1,),
                                                                                                          generator=g))]
        scale = 10.0 ** float(torch.randint(-3, 4, (1,), generator=g))
        offset = int(torch.randint(0, 4, (1,), generator=g))  # storage offsets break 16-byte alignment
        t = (torch.randn(n + 3, generator=g, dtype=torch.float64) * scale).to(dtype)[offset:offset + n]
        if n and torch.rand(1, generator=g) < 0.3:  # the largest value at an edge, negative
            t[-1 if i % 2 else 0] = -2 * float(t.abs().max()) - 1
        if n > 1 and torch.rand(1, generator=g) < 0.15:
            t[int(torch.randint(0, n, (1,), generator=g))] = float("nan")
        if n and torch.rand(1, generator=g) < 0.1:
            t[0] = float("-inf") if i % 3 else float("inf")
        if n >= 6 and torch.rand(1, generator=g) < 0.2:
            t = t[: n // 6 * 6].view(2, -1, 3).transpose(0, 1)  # not contiguous
        out.append(t.to(device))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_cpu_kernel_is_exact(seed):
    _ext()
    tensors = _tensors(seed)
    _same(kernels.multi_tensor_amax(tensors), _expected(tensors))
    _same(torch.ops.megatron_fsdp.multi_tensor_amax(tensors), _expected(tensors))


@pytest.mark.parametrize("seed", range(8))
def test_fallback_is_exact(seed):
    tensors = _tensors(seed)
    _same(amax._multi_tensor_amax_reference(tensors), _expected(tensors))


@pytest.mark.parametrize("seed", range(4))
def test_cuda_plan_on_the_host_is_exact(seed):
    # Every block and thread of the device kernel in turn: tiles, 16-byte vectors, the block max.
    tensors = _tensors(seed, count=12)
    _same(_ext().multi_tensor_amax_emulated(tensors), _expected(tensors))


def test_many_threads_and_large_tensors():
    _ext()
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) for n in [1 << 20, 3, (1 << 18) + 1, 5]]
    tensors[0][123_457] = 1e9
    tensors[2][-1] = -1e8
    before = torch.get_num_threads()
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        try:
            _same(kernels.multi_tensor_amax(tensors), _expected(tensors))
        finally:
            torch.set_num_threads(before)


def test_edge_cases():
    _ext()
    cases = [torch.tensor([-0.0]), torch.empty(0), torch.tensor(-3.5), torch.tensor([float("nan"), float("inf")]),
             torch.tensor([1e-45, -1e-44]), torch.tensor([-65504.0], dtype=torch.float16),
             torch.tensor([1e300], dtype=torch.float64), torch.tensor([-1e-40], dtype=torch.bfloat16)]
    got = kernels.multi_tensor_amax(cases)
    _same(got, _expected(cases))
    assert got[0].item() == 0 and not got[0].signbit() and got[1].item() == 0
    assert got[3].isnan() and got[6].isinf()  # NaN wins over inf; fp64 beyond fp32 rounds to inf
    assert kernels.multi_tensor_amax([]).shape == (0,)


def test_requires_grad_inputs_record_no_graph():
    w = torch.randn(10, requires_grad=True)
    out = kernels.multi_tensor_amax([w, w * 2])
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("path", ["kernel", "fallback"])
def test_bad_inputs_raise(path):
    if path == "kernel":
        _ext()
    fn = kernels.multi_tensor_amax if path == "kernel" else amax._multi_tensor_amax_reference
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype .*[Ii]nt"):
        fn([torch.ones(2), torch.ones(2, dtype=torch.int32)])
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is on meta but tensors\[0\] is on cpu"):
        fn([torch.ones(2), torch.ones(2, device="meta")])


def test_meta_kernel_gives_the_shape():
    _ext()
    out = torch.ops.megatron_fsdp.multi_tensor_amax([torch.empty(3, device="meta"), torch.empty(0, device="meta")])
    assert out.device.type == "meta" and out.shape == (2,) and out.dtype == torch.float32


@requires_cuda
@pytest.mark.parametrize("seed", range(8))
def test_cuda_kernel_is_exact(seed):
    tensors = _tensors(seed, device="cuda")
    _same(kernels.multi_tensor_amax(tensors), _expected(tensors))
    _same(torch.ops.megatron_fsdp.multi_tensor_amax(tensors), _expected(tensors))


@requires_cuda
def test_cuda_kernel_under_graph_capture():
    tensors = [torch.randn(n, device="cuda") for n in (5, 40_000, 1)]
    kernels.multi_tensor_amax(tensors)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.multi_tensor_amax(tensors)
    for t in tensors:
        t.normal_()
    graph.replay()
    torch.cuda.synchronize()
    _same(out, _expected(tensors))


# ---- cast_to_fp8 ----

FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _fp8_inputs(dtype, device="cpu"):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20_000, generator=g, dtype=torch.float64) * torch.logspace(-12, 6, 20_000, dtype=torch.float64)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 448.0, 464.0, 480.0, -1e6,
                            57344.0, 61440.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -16, 2.0 ** -17,
                            1.0625, 1.1875, -1.0625], dtype=torch.float64)
    return torch.cat([special, x]).to(dtype).to(device)


def _torch_fp8_bits(src, scale, fp8):
    fp8_max = FP8[fp8]
    return (src.float() * scale).clamp(-fp8_max, fp8_max).to(fp8).view(torch.uint8)


@pytest.mark.parametrize("fp8", list(FP8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["kernel", "fallback"])
def test_cast_to_fp8_is_bitwise_torch(path, dtype, fp8):
    src = _fp8_inputs(dtype)
    for scale_value in (1.0, 0.37, 1024.0):
        scale = torch.tensor(scale_value)
        expected = _torch_fp8_bits(src, scale, fp8)
        if path == "kernel":
            _ext()
            storage = torch.full((src.numel() + 5,), 7, dtype=torch.uint8)
            got = kernels.cast_to_fp8(src, scale, fp8, out=storage[3:3 + src.numel()])
            assert torch.equal(storage[:3], torch.full((3,), 7, dtype=torch.uint8)), "wrote before out"
            assert torch.equal(storage[-2:], torch.full((2,), 7, dtype=torch.uint8)), "wrote past out"
        else:
            got = torch.empty(src.numel(), dtype=torch.uint8)
            fp8_cast._cast_to_fp8_reference(src, scale, fp8, got)
        assert torch.equal(got, expected), (got != expected).nonzero()[:5]
    # Saturation: nothing is inf after the cast; e5m2's plain cast would overflow.
    assert not got.view(fp8).float().isinf().any()


@pytest.mark.parametrize("fp8", list(FP8))
def test_cast_to_fp8_rounds_every_exponent_like_torch(fp8):
    # Random float32 bit patterns over every exponent from fp8's subnormals to past its range, both signs.
    _ext()
    g = torch.Generator().manual_seed(2)
    n = 400_000
    exponent = torch.randint(90, 150, (n,), generator=g)
    mantissa = torch.randint(0, 1 << 23, (n,), generator=g)
    sign = torch.randint(0, 2, (n,), generator=g)
    bits = (sign << 31) | (exponent << 23) | mantissa
    x = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    for scale in (1.0, 3.0):
        expected = _torch_fp8_bits(x, torch.tensor(scale), fp8)
        assert torch.equal(kernels.cast_to_fp8(x, torch.tensor(scale), fp8), expected)


def test_ops_are_not_differentiable():
    _ext()
    w = torch.randn(10, requires_grad=True)
    assert not torch.ops.megatron_fsdp.multi_tensor_amax([w, w * 2]).requires_grad
    out = torch.empty(10, dtype=torch.uint8)
    torch.ops.megatron_fsdp.cast_to_fp8(w, torch.tensor(1.0), torch.float8_e4m3fn, out)
    assert not out.requires_grad


def test_cast_to_fp8_checks_arguments():
    _ext()
    src, scale = torch.ones(4), torch.tensor(1.0)
    with pytest.raises(RuntimeError, match="out must be a contiguous Byte tensor of 4 elements"):
        kernels.cast_to_fp8(src, scale, torch.float8_e4m3fn, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="scale must be a one-element Float tensor"):
        kernels.cast_to_fp8(src, torch.ones(2), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="dtype must be one of"):
        kernels.cast_to_fp8(src, scale, torch.bfloat16)


@requires_cuda
@pytest.mark.parametrize("fp8", list(FP8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_cast_to_fp8_is_bitwise_torch(dtype, fp8):
    src = _fp8_inputs(dtype, "cuda")
    scale = torch.tensor(0.37, device="cuda")
    assert torch.equal(kernels.cast_to_fp8(src, scale, fp8), _torch_fp8_bits(src, scale, fp8))
