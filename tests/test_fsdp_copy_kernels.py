"""Our kernels behind FSDP2's fsdp:: copy ops: bitwise torch's results.

Which kernel served an op is read from the profiler: where ours run, the
trace holds a `megatron_fsdp::<op>` range (csrc/bindings.cpp); torch's path
has none.
"""

import collections
import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from helpers import full_params, make_config, setup_parallel, tiered
from megatron_fsdp import _torch_compat, parallel_state
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.kernels import fsdp_copy_ops, fsdp_mixed_precision_hook
from megatron_fsdp.models.gpt import GPTModel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@contextlib.contextmanager
def kernels(enabled: bool):
    was = fsdp_copy_ops.fsdp_copy_kernels_enabled()
    if enabled:
        assert fsdp_copy_ops.enable_fsdp_copy_kernels()
    else:
        fsdp_copy_ops.disable_fsdp_copy_kernels()
    try:
        yield
    finally:
        if was:
            fsdp_copy_ops.enable_fsdp_copy_kernels()
        else:
            fsdp_copy_ops.disable_fsdp_copy_kernels()


def _shapes(g, count, min_rows=0, max_rows=9):
    shapes = []
    for _ in range(count):
        rows = int(torch.randint(min_rows, max_rows, (1,), generator=g))
        if torch.rand(1, generator=g) < 0.5:
            shapes.append((rows,))
        else:
            shapes.append((rows, int(torch.randint(1, 5, (1,), generator=g))))
    return shapes


def _profiled(fn):
    """fn()'s result and how often each of our fsdp:: kernels ran in it."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn()
    ours = {f"megatron_fsdp::{name}" for name in fsdp_copy_ops.EXPECTED_SCHEMAS}
    ran = collections.Counter(e.name.split("::")[1] for e in prof.events() if e.name in ours)
    return result, ran


def _run_both(fn):
    with kernels(False):
        expected, ran_off = _profiled(fn)
    assert not ran_off, f"our kernels ran while disabled: {ran_off}"
    with kernels(True):
        got, ran = _profiled(fn)
    return expected, got, ran


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_chunk_cat_is_bitwise_torch(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    world = int(torch.randint(1, 9, (1,), generator=g))
    # torch's _chunk_cat rejects empty tensors (ours accepts them): compare on what both take.
    count = int(torch.randint(1, 30, (1,), generator=g))
    tensors = [torch.randn(s, generator=g).to(dtype) for s in _shapes(g, count, min_rows=1)]
    if seed % 2:
        tensors[0] = torch.randn(6, 4, generator=g).to(dtype).t()  # non-contiguous gradient
    cols = sum(-(-t.size(0) // world) * (t.numel() // max(t.size(0), 1)) for t in tensors)
    out_dtype = torch.float32 if seed % 3 == 0 else dtype  # reduce-dtype cast on the way

    def run():
        out = torch.full((world, cols), float("nan"), dtype=out_dtype)
        torch.ops.fsdp.chunk_cat(tensors, 0, world, out=out)
        return out

    expected, got, ran = _run_both(run)
    assert ran.get("chunk_cat") == 1
    assert torch.equal(got.view(torch.uint8 if out_dtype != torch.float32 else torch.int32),
                       expected.view(torch.uint8 if out_dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_all_gather_copy_in_and_copy_out_are_bitwise_torch(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    world = int(torch.randint(1, 9, (1,), generator=g))
    rank = int(torch.randint(0, world, (1,), generator=g))
    inputs = [torch.randn(s, generator=g).to(dtype).reshape(-1) for s in _shapes(g, 25)]
    sizes = [t.numel() for t in inputs]
    numel = sum(sizes)
    storage = torch.zeros(numel * world + 3, dtype=dtype)

    def copy_in():
        out = storage.clone()[3:]  # misaligned storage offset
        ag_input, ag_output = torch.ops.fsdp.all_gather_copy_in(inputs, out, sizes, numel, rank)
        assert ag_output.data_ptr() == out.data_ptr()
        assert ag_input.data_ptr() == out.data_ptr() + numel * rank * out.element_size()
        return out.clone()

    expected, got, ran = _run_both(copy_in)
    assert ran.get("all_gather_copy_in") == 1 and torch.equal(got, expected)

    gathered = torch.randn(world, numel, generator=g).to(dtype)

    def copy_out():
        outs = [torch.full((world, s), -1.0, dtype=dtype) for s in sizes]
        torch.ops.fsdp.split_with_sizes_copy(gathered, sizes, dim=1, out=outs)
        return outs

    expected, got, ran = _run_both(copy_out)
    assert ran.get("split_with_sizes_copy") == 1
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_wrong_outputs_raise_before_writing():
    with kernels(True):
        grads = [torch.ones(5), torch.ones(3, 2)]
        out = torch.zeros(4, 7)  # needs 2 + 2 = 4 columns... per rank: ceil(5/4)=2, ceil(3/4)*2=2
        with pytest.raises(RuntimeError, match="chunk_cat: the padded chunks hold 4 elements per row but out has 7"):
            torch.ops.megatron_fsdp.chunk_cat(grads, 4, out)
        assert torch.count_nonzero(out) == 0
        src = torch.ones(2, 5)
        outs = [torch.zeros(2, 2), torch.zeros(2, 2)]
        with pytest.raises(RuntimeError, match="split sizes add up to 4 but src has 5 columns"):
            torch.ops.megatron_fsdp.split_copy_out(src, [2, 2], outs)
        with pytest.raises(RuntimeError, match=r"out\[1\] has shape \[2, 2\], expected \[2, 3\]"):
            torch.ops.megatron_fsdp.split_copy_out(src, [2, 3], outs)
        assert all(torch.count_nonzero(o) == 0 for o in outs)


def test_other_schema_falls_back_with_one_warning(monkeypatch):
    with kernels(False):
        monkeypatch.setitem(fsdp_copy_ops.EXPECTED_SCHEMAS, "chunk_cat", "fsdp::chunk_cat(Tensor[] x) -> ()")
        monkeypatch.setattr(fsdp_copy_ops, "_warned", False)
        with pytest.warns(RuntimeWarning, match="torch's FSDP copy path runs.*chunk_cat"):
            assert not fsdp_copy_ops.enable_fsdp_copy_kernels()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not fsdp_copy_ops.enable_fsdp_copy_kernels()  # no second warning
        assert not fsdp_copy_ops.fsdp_copy_kernels_enabled()


def _case_stock_fsdp2_unless_asked():
    # A wrapper whose config does not ask leaves torch's copy ops alone: no megatron_fsdp range in a
    # whole training step. One that asks installs them for the process, and says so.
    fsdp_copy_ops.disable_fsdp_copy_kernels()
    setup_parallel(1)
    cfg = make_config(hidden_size=32, ffn_hidden_size=48)
    for asked in (False, True):
        wrapped = TorchFullyShardedDataParallel(
            cfg, TorchFullyShardedDataParallelConfig(fsdp_copy_kernels=asked),
            GPTModel(cfg, vocab_size=64, max_sequence_length=16))
        assert wrapped.fsdp_copy_kernels_active == asked == fsdp_copy_ops.fsdp_copy_kernels_enabled()
        ids = torch.randint(0, 64, (2, 16))
        _, ran = _profiled(lambda: wrapped(ids, torch.arange(16).expand(2, 16), None, labels=ids).sum().backward())
        assert bool(ran) == asked and (not asked or set(ran) == set(fsdp_copy_ops.EXPECTED_SCHEMAS)), ran
    fsdp_copy_ops.disable_fsdp_copy_kernels()
    assert not fsdp_copy_ops.fsdp_copy_kernels_enabled()
    parallel_state.destroy_model_parallel()


def test_stock_fsdp2_unless_the_config_asks(pools):
    pools(2).run(_case_stock_fsdp2_unless_asked)


def test_the_config_field_is_checked():
    with pytest.raises(ValueError, match="fsdp_copy_kernels must be True or False, got 1"):
        TorchFullyShardedDataParallelConfig(fsdp_copy_kernels=1)


def test_mixed_precision_hook_fits_this_torch():
    # Fails loudly when torch changes the FSDP2 internals the hook replaces.
    assert fsdp_mixed_precision_hook.supported(), f"torch {torch.__version__}: update fsdp_mixed_precision_hook"
    with kernels(True):
        assert fsdp_mixed_precision_hook.installed()
    with kernels(False):
        assert not fsdp_mixed_precision_hook.installed()


@contextlib.contextmanager
def _watch_fused_cast(seen: list):
    """Records, for each all-gather input FSDP2 builds, whether it reached the
    copy-in uncast (marked by fsdp_mixed_precision_hook)."""
    hooked = {}

    def watching(fsdp_params):
        inputs = hooked["_get_param_all_gather_inputs"](fsdp_params)
        seen.extend(hasattr(t, fsdp_mixed_precision_hook._CAST_ATTR) for group in inputs for t in group)
        return inputs

    hooked.update(_torch_compat.replace_all_gather_input_functions({"_get_param_all_gather_inputs": watching}))
    try:
        yield
    finally:
        _torch_compat.replace_all_gather_input_functions(hooked)


def _train(tp, use_kernels, steps=3, precision=None):
    setup_parallel(tp)
    cfg = make_config(hidden_size=36, ffn_hidden_size=50, sequence_parallel=tp > 1,
                      bf16=precision == "bf16", fp16=precision == "fp16")
    model = GPTModel(cfg, vocab_size=66 if tp == 1 else 64, max_sequence_length=16)
    fsdp_copy_ops.disable_fsdp_copy_kernels()  # the wrapper installs them when its config asks
    wrapped = TorchFullyShardedDataParallel(
        cfg, TorchFullyShardedDataParallelConfig(fsdp_copy_kernels=use_kernels), model)
    assert fsdp_copy_ops.fsdp_copy_kernels_enabled() == use_kernels == wrapped.fsdp_copy_kernels_active
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
    uncast = []

    def step():
        ids = torch.randint(0, 64, (2, 16), generator=g)
        loss = wrapped(ids, torch.arange(16).expand(2, 16), None, labels=ids).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    # The first step under the profiler (every op of a step runs there; reading a profile costs
    # more than the steps it saw), the others as they are.
    with _watch_fused_cast(uncast):
        first, ran = _profiled(step)
    losses = [first, *(step() for _ in range(steps - 1))]
    ran["fused_cast_inputs"] = sum(uncast)
    weights = full_params(wrapped.module)
    parallel_state.destroy_model_parallel()
    return torch.stack(losses), weights, ran


def _case_training_identical(tp, precision):
    try:
        off_losses, off_weights, off_ran = _train(tp, False, precision=precision)
        on_losses, on_weights, on_ran = _train(tp, True, precision=precision)
    finally:
        fsdp_copy_ops.disable_fsdp_copy_kernels()
    assert not any(off_ran.values()), f"kernels ran while disabled: {off_ran}"
    for op in ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat"):
        assert on_ran.get(op, 0) > 0, f"{op} never ran through our kernel: {on_ran}"
    # Under mixed precision the fp32 shards reach the copy-in uncast: one pass, no temporary.
    assert (on_ran["fused_cast_inputs"] > 0) == (precision is not None), on_ran
    assert torch.equal(on_losses, off_losses), f"{on_losses} != {off_losses}"
    for name in off_weights:
        assert torch.equal(on_weights[name], off_weights[name]), name
    dist.barrier()


# Pairwise: each TP size and each precision (no cast, bf16 and fp16 casts in the copy-in) once;
# the 2D (TP x FSDP) parameters with the cast, the hardest combination.
@pytest.mark.parametrize("tp,precision", tiered([(1, None), (2, "bf16"), (1, "fp16")], [(1, "fp16")]))
def test_training_is_bitwise_identical_with_kernels(pools, tp, precision):
    pools(4).run(_case_training_identical, tp, precision)
