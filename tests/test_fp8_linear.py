"""fp8 GEMMs: the fp8 linear against a float64 reference and an independent
emulation of fp8 rounding, the scaling rules, and fp8 in the parallel layers
and the GPT model at TP=1, TP=2 and TP=2 with sequence parallelism."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import full_grads, make_config, setup_parallel
from megatron_fsdp.fp8 import Fp8LinearState, Fp8Recipe, convert_to_fp8, fp8_linear, gemm, refresh_fp8_scales
from megatron_fsdp.fp8.scaling import AmaxHistory, cast_to_fp8, scale_from_amax
from megatron_fsdp.fp8.weight import Fp8TrainingWeight, Fp8WeightMeta
from megatron_fsdp.models.gpt import GPTModel

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}
# Relative error (Frobenius) of one GEMM with both operands rounded to fp8:
# e4m3 keeps 3 mantissa bits (half-ulp 2**-4), e5m2 keeps 2 (2**-3); random
# rounding errors add up to about 0.04 and 0.06 here. The bounds leave room
# and are far below what a wrong scale or format gives (>= 0.3).
TOLERANCE = {"forward": 0.06, "e4m3": 0.06, "hybrid": 0.09}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def _emulated(t: torch.Tensor, dtype, amax=None) -> torch.Tensor:
    """t rounded to fp8 with per-tensor scaling, computed here independently:
    scale = max / amax in float64, then float32; clamp; round; divide."""
    amax = float(t.detach().abs().max()) if amax is None else amax
    scale = torch.tensor(MAX[dtype] / amax, dtype=torch.float64).float()
    q = (t.detach().float() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.double() / scale.double()


def _run(recipe: Fp8Recipe, x, w, g):
    state = Fp8LinearState(recipe)
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fp8_linear(x, w, state)
    y.backward(g)
    return y, x.grad, w.grad, state


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("wgrad", [True, False])
def test_fp8_linear_matches_reference_and_fp8_emulation(fmt, recipe, wgrad):
    # 3-D input with 15 tokens: the weight-gradient GEMM pads the tokens to 16.
    x = torch.randn(3, 5, 64, generator=_gen(0))
    w = torch.randn(48, 64, generator=_gen(1)) * 0.05
    g = torch.randn(3, 5, 48, generator=_gen(2))
    y, dx, dw, _ = _run(Fp8Recipe(format=fmt, recipe=recipe, wgrad=wgrad), x, w, g)
    assert y.shape == (3, 5, 48) and y.dtype == torch.float32 and not y._is_view()
    xd, wd, gd = x.double(), w.double(), g.double().reshape(-1, 48)

    # Against the float64 result, within fp8 precision.
    assert _rel(y, xd @ wd.t()) < TOLERANCE["forward"]
    assert _rel(dx, gd.reshape(3, 5, 48) @ wd) < TOLERANCE[fmt]
    dw_ref = gd.t() @ xd.reshape(-1, 64)
    if wgrad:
        assert _rel(dw, dw_ref) < TOLERANCE[fmt]
    else:  # high-precision weight gradient
        torch.testing.assert_close(dw.double(), dw_ref, rtol=1e-5, atol=1e-6)

    # Exactly fp8 arithmetic: equal to the emulated rounding up to fp32 summation.
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    qx, qw, qg = _emulated(x, E4M3), _emulated(w, E4M3), _emulated(g, grad_dtype).reshape(-1, 48)
    torch.testing.assert_close(y.double(), qx @ qw.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.double(), (qg @ qw).reshape(3, 5, 64), rtol=1e-5, atol=1e-5)
    if wgrad:
        torch.testing.assert_close(dw.double(), qg.t() @ qx.reshape(-1, 64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algo,history_len", [("most_recent", 1), ("max", 3)])
def test_delayed_scaling_uses_the_previous_steps_amax(algo, history_len):
    recipe = Fp8Recipe(format="hybrid", recipe="delayed", amax_history_len=history_len, amax_compute_algo=algo,
                       margin=1)
    state = Fp8LinearState(recipe)
    w = torch.randn(32, 32, generator=_gen(1))
    amaxes = []
    for step, magnitude in enumerate([4.0, 1.0, 2.0]):
        x = torch.randn(16, 32, generator=_gen(10 + step)) * magnitude
        y = fp8_linear(x, w, state)
        if step == 0:  # no history yet: current scaling
            expected_amax = float(x.abs().max())
        else:
            history = amaxes[-history_len:]
            expected_amax = amaxes[-1] if algo == "most_recent" else max(history)
        # margin=1 halves every scale: tensors are rounded with max / amax / 2.
        qx = _emulated(x, E4M3, amax=expected_amax * 2)
        torch.testing.assert_close(y.double(), qx @ _emulated(w, E4M3, amax=float(w.abs().max()) * 2).t(),
                                   rtol=1e-5, atol=1e-5)
        amaxes.append(float(x.abs().max()))
        refresh_fp8_scales([_Holder(state)])
        assert float(state.input.amax_history[0]) == amaxes[-1]
    # A forward without autograd (evaluation) leaves the history alone.
    scale = state.input.scale.clone()
    with torch.no_grad():
        fp8_linear(torch.full((16, 32), 1e4), w, state)
    refresh_fp8_scales([_Holder(state)])
    assert float(state.input.amax_history[0]) == 0.0 and float(state.input.amax_history.max()) < 1e4
    if algo == "most_recent":
        assert torch.equal(state.input.scale, scale)  # an amax of zero keeps the previous scale


class _Fp8Copies(TorchDispatchMode):
    """Records every op that copies an fp8 tensor (or its bytes) into new fp8 memory: a
    transpose made contiguous, a pad, a clone. (The CPU's GEMM reads its fp8 operands as
    float32, `_to_copy` to float32: the GEMM itself, not a copy of an operand.)"""

    COPIES = {"clone", "copy_", "constant_pad_nd", "_to_copy", "cat", "stack", "contiguous"}
    FP8_BYTES = (E4M3, E5M2, torch.uint8)

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        if name in self.COPIES:
            inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)] or inputs[:1]
            if any(t.dtype in self.FP8_BYTES for t in inputs) and any(t.dtype in self.FP8_BYTES for t in outputs):
                self.copies.append(name)
        return out


@pytest.mark.parametrize("weight_kind", ["plain", "fp8 training weight"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_no_fp8_operand_is_copied_into_another_layout(recipe, weight_kind):
    """Each cast writes its operand in both layouts the GEMMs take (issue 20): forward and
    backward copy no fp8 tensor, the weight-gradient GEMM's token padding included (15 tokens)."""
    state = Fp8LinearState(Fp8Recipe(format="hybrid", recipe=recipe))
    w = torch.randn(48, 64, generator=_gen(1)) * 0.05
    if weight_kind == "fp8 training weight":
        w = Fp8TrainingWeight(w, Fp8WeightMeta(E4M3, margin=0))
        w._fp8_meta.scale = scale_from_amax(w._data.abs().max().float(), E4M3)
    w.requires_grad_(True)
    for step in range(2):  # delayed: the second step casts with the history's scale
        x = torch.randn(3, 5, 64, generator=_gen(step)).requires_grad_(True)
        with _Fp8Copies() as mode:
            fp8_linear(x, w, state).backward(torch.randn(3, 5, 48, generator=_gen(9)))
        assert mode.copies == [], mode.copies
        assert x.grad is not None and w.grad is not None
        if recipe == "delayed":
            refresh_fp8_scales([_Holder(state)])


class _HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in (torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.tolist)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("algo", ["most_recent", "max"])
def test_a_non_finite_amax_leaves_the_history_and_is_decided_on_the_device(algo):
    history = AmaxHistory(3, algo, E4M3, margin=0)
    history.record(torch.tensor(float("inf")))
    history.update(torch.tensor(float("inf")))  # the first steps overflow (fp16): nothing to learn from
    assert not history.calibrated and float(history.amax_history.max()) == 0.0 and float(history.scale) == 1.0
    history.record(torch.tensor(2.0))
    history.update(torch.tensor(2.0))
    assert history.calibrated and history.amax_history.tolist() == [2.0, 0.0, 0.0]
    assert float(history.scale) == pytest.approx(224.0)
    for amax in (float("inf"), float("nan")):
        with _HostReads() as mode:
            history.record(torch.tensor(amax))
            history.update(torch.tensor(amax))
        assert mode.reads == 0  # calibrated: the device decides
        assert history.amax_history.tolist() == [2.0, 0.0, 0.0] and float(history.scale) == pytest.approx(224.0)
        assert float(history.pending) == 0.0
    history.update(torch.tensor(8.0))
    assert history.amax_history.tolist() == [8.0, 2.0, 0.0] and float(history.scale) == pytest.approx(56.0)


class _Holder(torch.nn.Module):
    """A module holding an fp8 linear state, as a parallel linear does."""

    def __init__(self, state):
        super().__init__()
        self.fp8_state = state


def test_e5m2_gradients_saturate_instead_of_overflowing():
    state = Fp8LinearState(Fp8Recipe(format="hybrid", recipe="delayed"))
    holder = _Holder(state)
    x = torch.randn(16, 32, generator=_gen(0)).requires_grad_(True)
    w = torch.randn(32, 32, generator=_gen(1)).requires_grad_(True)
    fp8_linear(x, w, state).backward(torch.ones(16, 32) * 1e-3)
    refresh_fp8_scales(holder)  # the output-gradient scale now expects an amax of 1e-3
    x.grad = w.grad = None
    fp8_linear(x, w, state).backward(torch.ones(16, 32) * 1e3)  # a million times larger
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    # Every gradient element saturated at e5m2's largest value over the scale.
    per_element = 57344.0 / float(state.grad_output.scale)
    torch.testing.assert_close(x.grad, torch.ones(16, 32) @ _emulated(w, E4M3).float() * per_element,
                               rtol=1e-5, atol=0)
    # The cast alone: without the clamp float32 -> e5m2 gives inf.
    big = torch.tensor([1e6, -1e6, float("inf")])
    assert torch.isinf(big.to(E5M2).float()).all()
    assert cast_to_fp8(big, torch.tensor(1.0), E5M2).float().tolist() == [57344.0, -57344.0, 57344.0]
    assert cast_to_fp8(big, torch.tensor(1.0), E4M3).float().tolist() == [448.0, -448.0, 448.0]


def test_scale_from_amax_rules():
    amax = torch.tensor([3.0, 0.0, float("inf"), float("nan"), 1e-45])
    previous = torch.tensor([1.0, 5.0, 6.0, 7.0, 1.0])
    s = scale_from_amax(amax, E4M3, margin=2, previous=previous)
    assert s.dtype == torch.float32
    assert float(s[0]) == float(torch.tensor(448.0 / 3.0 / 4.0, dtype=torch.float64).float())
    assert s[1:4].tolist() == [5.0, 6.0, 7.0]  # zero / non-finite amax: keep the previous scale
    assert float(s[4]) == torch.finfo(torch.float32).max  # no inf for a denormal amax
    assert float(scale_from_amax(torch.tensor(0.0), E5M2)) == 1.0


# ---------------------------------------------------------------- layers and models

@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_gemm_is_torchs_scaled_mm_and_keeps_its_operand_rules(rowwise, out_dtype):
    a = (torch.randn(48, 64, generator=_gen(0)) * 40).to(E4M3)
    b = (torch.randn(32, 64, generator=_gen(1)) * 4000).to(E5M2).t()  # column-major
    scale_a = torch.rand(48, 1, generator=_gen(2)) + 0.5 if rowwise else torch.tensor(0.7)
    scale_b = torch.rand(1, 32, generator=_gen(3)) + 0.5 if rowwise else torch.tensor(1.3)
    ours = gemm.scaled_mm(a, b, scale_a, scale_b, out_dtype)
    assert ours.dtype == out_dtype and ours.shape == (48, 32)
    tolerance = 1e-6 if out_dtype == torch.float32 else 1e-2
    # The definition: every fp8 value, scale and product is exact in float64.
    exact = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
    assert _rel(ours, exact) < tolerance, _rel(ours, exact)
    try:
        theirs = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    except RuntimeError as error:  # torch 2.11's CPU _scaled_mm takes per-tensor scales only
        assert rowwise and "only supports per-tensor scaling for CPU" in str(error), error
    else:
        # The same exact products, summed in float32 in another order (then rounded to out_dtype).
        assert _rel(ours, theirs) < tolerance, _rel(ours, theirs)
    out = torch.empty(48, 32, dtype=out_dtype)
    assert gemm.scaled_mm(a, b, scale_a, scale_b, out_dtype, out=out) is out and torch.equal(out, ours)
    with pytest.raises(RuntimeError, match="the first operand must be row-major and the second column-major"):
        gemm.scaled_mm(a, b.contiguous(), scale_a, scale_b, out_dtype)
    with pytest.raises(RuntimeError, match=r"the scale of a must have one element or shape \(48, 1\)"):
        gemm.scaled_mm(a, b, torch.ones(48), scale_b, out_dtype)


def _gpt_config(tp, fp8, sp=False, **overrides):
    fields = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, fp8=fp8, sequence_parallel=sp,
                  tensor_model_parallel_size=tp)
    return make_config(**{**fields, **overrides})


def _case_gpt_step(tp, sp, fp8, recipe="tensorwise"):
    """Loss and full gradients of one GPT forward/backward; counts fp8 GEMMs."""
    setup_parallel(tp)
    cfg = _gpt_config(tp, fp8, sp, fp8_recipe=recipe)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=16)
    assert convert_to_fp8(model) == (8 if fp8 else 0)
    calls = []
    original = gemm._check_operands  # every fp8 GEMM on the CPU passes its operands through it

    def counting(a, *args, **kwargs):
        calls.append(a.dtype)
        return original(a, *args, **kwargs)

    ids = torch.randint(0, 64, (2, 16), generator=_gen(5))
    labels = torch.randint(0, 64, (2, 16), generator=_gen(6))
    gemm._check_operands = counting
    try:
        loss = model(ids, torch.arange(16).expand(2, 16), None, labels=labels).mean()
        loss.backward()
    finally:
        gemm._check_operands = original
    fp8_layers = [name for name, m in model.named_modules() if getattr(m, "fp8_state", None) is not None]
    return loss.item(), full_grads(model), len(calls), fp8_layers


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise"])
def test_gpt_fp8_at_tp2_and_sequence_parallel_matches_tp1(pools, recipe):
    pool = pools(2)
    exact_loss, exact_grads, no_calls, no_layers = pool.run(_case_gpt_step, 1, False, None)[0]
    assert no_calls == 0 and no_layers == []
    results = {name: pool.run(_case_gpt_step, tp, sp, "hybrid", recipe)[0]
               for name, tp, sp in (("tp1", 1, False), ("tp2", 2, False), ("tp2_sp", 2, True))}
    for name, (loss, grads, calls, layers) in results.items():
        # QKV, attention output, fc1, fc2 in both layers; 3 GEMMs each; the output layer stays high precision.
        assert len(layers) == 8 and not any("output_layer" in n for n in layers), layers
        assert calls == 24, f"{name}: {calls} fp8 GEMMs"
        assert abs(loss - exact_loss) / exact_loss < 0.01, (name, loss, exact_loss)
        assert loss != exact_loss, f"{name}: fp8 loss equals the fp32 loss"
        for key, g in grads.items():
            if "linear" in key and key.endswith("weight"):
                assert _rel(g, exact_grads[key]) < 0.25, (name, key, _rel(g, exact_grads[key]))
    tp1_loss, tp1_grads = results["tp1"][:2]
    for name in ("tp2", "tp2_sp"):
        loss, grads = results[name][:2]
        assert abs(loss - tp1_loss) / tp1_loss < 0.005, (name, loss, tp1_loss)
        for key in tp1_grads:
            assert _rel(grads[key], tp1_grads[key]) < 0.15, (name, key, _rel(grads[key], tp1_grads[key]))


def _case_first_last_layers_bf16():
    setup_parallel(1)
    cfg = _gpt_config(1, "e4m3", num_layers=4, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                      num_layers_at_end_in_bf16=2)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=16)
    convert_to_fp8(model)
    return {i: [n for n, m in layer.named_modules() if getattr(m, "fp8_state", None) is not None]
            for i, layer in enumerate(model.decoder.layers)}


def test_first_last_layers_stay_in_high_precision(pools):
    layers = pools(2).run(_case_first_last_layers_bf16)[0]
    assert [bool(v) for v in layers.values()] == [False, True, False, False]
    assert sorted(layers[1]) == ["mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj",
                                 "self_attention.linear_qkv"]


def _case_fp8_shape_rule():
    setup_parallel(2)
    convert_to_fp8(GPTModel(_gpt_config(2, "hybrid", ffn_hidden_size=80), vocab_size=64, max_sequence_length=16))


def test_fp8_layers_need_gemm_dimensions_in_multiples_of_16(pools):
    errors = pools(2).run_expecting_errors(_case_fp8_shape_rule)
    for e in errors:
        assert e.type_name == "ValueError"
        assert "ColumnParallelLinear: an fp8 linear needs both dimensions of its local weight to be multiples " \
               "of 16" in e.message and "[out, in] = [40, 64]" in e.message, e.message


def _case_converter_in_place():
    from megatron_fsdp.fp8 import Fp8ColumnParallelLinear, Fp8RowParallelLinear
    from megatron_fsdp.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    setup_parallel(1)
    model = GPTModel(_gpt_config(1, "hybrid"), vocab_size=64, max_sequence_length=16)
    ids = torch.randint(0, 64, (2, 16), generator=_gen(7))
    # config.fp8 without the converter is refused, never run in high precision silently.
    with pytest.raises(RuntimeError, match="not converted to fp8.*convert_to_fp8"):
        model(ids, torch.arange(16).expand(2, 16), None, labels=ids)
    params = dict(model.named_parameters())
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert convert_to_fp8(model) == 8 and convert_to_fp8(model) == 8  # the second call changes nothing
    # One post-step hook (the scale refresh), which get_megatron_optimizer's step() will run.
    from megatron_fsdp.utils import post_step_hooks

    assert len(post_step_hooks([model])) == 1
    # The same module objects and parameters, with an fp8 class; the output layer stays as it was.
    assert model.decoder.layers[0].self_attention.linear_qkv is qkv and type(qkv) is Fp8ColumnParallelLinear
    assert type(model.decoder.layers[0].mlp.linear_fc2) is Fp8RowParallelLinear
    assert type(model.output_layer) is ColumnParallelLinear and isinstance(qkv, ColumnParallelLinear)
    assert not isinstance(model.output_layer, RowParallelLinear)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert "fp8=hybrid" in repr(qkv)
    model(ids, torch.arange(16).expand(2, 16), None, labels=ids).sum().backward()


def test_the_converter_is_where_fp8_enters(pools):
    pools(2).run(_case_converter_in_place)
