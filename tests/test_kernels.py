"""The extension's pack_into op against torch's own copies."""

import os

import pytest
import torch

from megatron_fsdp import kernels

def test_extension_is_built_when_required():
    if os.environ.get("MEGATRON_FSDP_REQUIRE_EXTENSION") != "1":
        pytest.skip("MEGATRON_FSDP_REQUIRE_EXTENSION is not set")
    assert kernels.extension_available(), f"extension failed to import: {kernels.extension_import_error()}"
    assert hasattr(torch.ops.megatron_fsdp, "pack_into")


def _random_inputs(seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(int(torch.randint(1, 40, (1,), generator=g))):
        shape = tuple(int(s) for s in torch.randint(0, 7, (int(torch.randint(0, 4, (1,), generator=g)),),
                                                    generator=g))
        dtype = [torch.float32, torch.bfloat16, torch.float16, torch.float64][int(torch.randint(0, 4, (1,), generator=g))]
        t = torch.randn(shape, generator=g).to(dtype)
        if t.dim() >= 2 and torch.rand(1, generator=g) < 0.3:
            t = t.transpose(0, 1)  # non-contiguous
        inputs.append(t.to(device))
    return inputs


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(8))
def test_pack_into_matches_cat(seed, out_dtype):
    inputs = _random_inputs(seed)
    total = sum(t.numel() for t in inputs)
    out = torch.full((total + 3,), -7.0, dtype=out_dtype)
    kernels.pack_into(inputs, out)
    expected = torch.cat([t.reshape(-1).to(out_dtype) for t in inputs]) if inputs else torch.empty(0, dtype=out_dtype)
    assert torch.equal(out[:total], expected)
    assert torch.equal(out[total:], torch.full((3,), -7.0, dtype=out_dtype)), "wrote past the packed elements"


def test_pack_into_handles_misaligned_storage_and_views():
    base = torch.arange(100, dtype=torch.float32)
    inputs = [base[1:8], base[13:14], base[20:40].view(4, 5)[:, 1:3], torch.empty(0)]
    out_storage = torch.zeros(64)
    out = out_storage[3:3 + 7 + 1 + 8]  # misaligned, still contiguous 1-D
    kernels.pack_into(inputs, out)
    assert torch.equal(out, torch.cat([t.reshape(-1) for t in inputs]))
    assert torch.count_nonzero(out_storage[:3]) == 0 and torch.count_nonzero(out_storage[19:]) == 0


@pytest.mark.parametrize("pack", [kernels.pack_into, kernels._pack_into_reference], ids=["op", "fallback"])
def test_pack_into_rejects_bad_output_before_writing(pack):
    inputs = [torch.ones(5), torch.ones(6)]
    small = torch.zeros(10)
    with pytest.raises(RuntimeError, match="inputs hold 11 elements but out has only 10"):
        pack(inputs, small)
    assert torch.count_nonzero(small) == 0, "nothing may be written when the output is too small"
    with pytest.raises(RuntimeError, match="1-D"):
        pack(inputs, torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match="contiguous"):
        pack(inputs, torch.zeros(40)[::2])


def test_large_pieces_take_the_aten_path_bitwise():
    # Pieces of 2^20 elements go to ATen's multi-threaded copy after the
    # parallel pass; casts of 2^12 and more use ATen's cast inside it.
    g = torch.Generator().manual_seed(0)
    ext = kernels._load_extension()
    if isinstance(ext, ImportError):
        pytest.skip(f"extension not built: {ext}")
    for out_dtype in (torch.float32, torch.bfloat16):
        inputs = [torch.randn((1 << 20) + 3, generator=g), torch.randn(5, generator=g),
                  torch.randn((1 << 16) + 1, generator=g).to(torch.bfloat16)]
        total = sum(t.numel() for t in inputs)
        out = torch.zeros(total, dtype=out_dtype)
        kernels.pack_into(inputs, out)
        assert torch.equal(out, torch.cat([t.to(out_dtype) for t in inputs]))
    world, sizes = 2, [(1 << 20) + 1, 3]
    src = torch.randn(world, sum(sizes), generator=g)
    outs = [torch.empty(world, s) for s in sizes]
    ext.split_copy_out(src, sizes, outs)
    assert all(torch.equal(o, e) for o, e in zip(outs, torch.split(src, sizes, dim=1)))
    grads = [torch.randn((1 << 21) + 1, generator=g), torch.randn(3, generator=g)]
    cols = sum(-(-t.numel() // world) for t in grads)
    out, expected = torch.empty(world, cols), torch.empty(world, cols)
    ext.chunk_cat(grads, world, out)
    torch._chunk_cat(grads, 0, world, out=expected)
    assert torch.equal(out, expected)


def test_lazy_negative_and_conjugate_views_are_resolved():
    ext = kernels._load_extension()
    if isinstance(ext, ImportError):
        pytest.skip(f"extension not built: {ext}")
    x = torch.arange(1.0, 5.0)
    out = torch.zeros(4)
    kernels.pack_into([torch._neg_view(x)], out)
    assert torch.equal(out, -x)
    z = torch.randn(4, 2, dtype=torch.complex64)
    cc_out = torch.zeros(2, 4, dtype=torch.complex64)
    ext.chunk_cat([z.conj()], 2, cc_out)
    assert torch.equal(cc_out, z.conj().resolve_conj().reshape(2, 4))
    with pytest.raises(RuntimeError, match="conjugate or negative view"):
        kernels.pack_into([x], torch._neg_view(out))


def test_complex_parameters_and_inference_mode():
    # FSDP2 gathers complex parameters too; and ATen copies inside the parallel
    # pass run with the caller's inference mode.
    with torch.inference_mode():
        z = [torch.randn(3, 2, dtype=torch.complex64), torch.randn(5, dtype=torch.complex64)]
        strided = torch.randn(6, 4).t()
        out = torch.zeros(11, dtype=torch.complex64)
        kernels.pack_into(z, out)
        assert torch.equal(out, torch.cat([t.reshape(-1) for t in z]))
        flat = torch.zeros(24)
        kernels.pack_into([strided], flat)
        assert torch.equal(flat, strided.reshape(-1))


def test_fsdp_op_checks_its_split_sizes_and_outputs():
    from megatron_fsdp import _torch_compat
    from megatron_fsdp.kernels import fsdp_copy_ops

    _torch_compat.fsdp_collectives_module()  # defines fsdp::

    assert fsdp_copy_ops.enable_fsdp_copy_kernels()
    try:
        _check_fsdp_op_errors()
    finally:
        fsdp_copy_ops.disable_fsdp_copy_kernels()


def _check_fsdp_op_errors():
    out = torch.zeros(20)
    with pytest.raises(RuntimeError, match="split sizes add up to 5 but all_gather_input_numel is 6"):
        torch.ops.fsdp.all_gather_copy_in([torch.ones(2), torch.ones(3)], out, [2, 3], 6, 0)
    with pytest.raises(RuntimeError, match="input 1 has 3 elements but its split size is 4"):
        torch.ops.fsdp.all_gather_copy_in([torch.ones(2), torch.ones(3)], out, [2, 4], 6, 0)
    assert torch.count_nonzero(out) == 0
    overlapping = torch.zeros(3).expand(2, 3)  # both rows are the same memory
    with pytest.raises(RuntimeError, match="single memory location"):
        torch.ops.fsdp.split_with_sizes_copy(torch.ones(2, 3), [3], dim=1, out=[overlapping])
