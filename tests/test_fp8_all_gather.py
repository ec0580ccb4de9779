"""fp8 weight all-gather through FSDP2's extension, with raw `fully_shard` on
"cpu" meshes (gloo): the gathered fp8 weight is the full weight cast with the
same scale, bit for bit, for even and uneven shards, 1-D, HSDP with a shard
group of one and TP x FSDP; it follows every optimizer step; the all-gather
moves half the bytes of bf16; meta-device models; bad combinations."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import full_tensor, make_config, setup_parallel
from megatron_fsdp import _torch_compat, parallel_state, tensor_parallel
from megatron_fsdp.fp8 import (
    Fp8GatheredWeight,
    Fp8Recipe,
    check_fp8_param_gather,
    convert_to_fp8_weights,
    is_fp8_training_weight,
    refresh_fp8_scales,
    to_fp8_linear,
)
from megatron_fsdp.initialization import initialize_parameters
from megatron_fsdp.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_fsdp.transformer.utils import init_method_normal

E4M3 = torch.float8_e4m3fn
SEED = 1234
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)

# name: (world size, tp, parallel_state kwargs, column out features, row out features)
LAYOUTS = {
    "dp2_even": (2, 1, {}, 64, 32),
    # 35 rows: shards of 18 and 17; 1 row: one rank holds an empty shard.
    "dp2_uneven": (2, 1, {}, 35, 1),
    # HSDP, 2 replicas of a shard group of one rank.
    "hsdp_shard_group_of_1": (2, 1, dict(num_distributed_optimizer_instances=2), 35, 3),
    # TP x FSDP: local rows 35 (column) and 3 (row) over 2 data-parallel ranks.
    "dp2_tp2_uneven": (4, 2, {}, 70, 3),
    "dp2_tp2_even": (4, 2, {}, 64, 32),
}
IN_FEATURES = 32


class _Net(nn.Module):
    """Column- then row-parallel linear, both with fp8 GEMMs."""

    def __init__(self, cfg, col_out, row_out, bias=True, fp8=True):
        super().__init__()
        init = init_method_normal(0.02)
        self.col = ColumnParallelLinear(IN_FEATURES, col_out, config=cfg, init_method=init, bias=bias)
        self.row = RowParallelLinear(col_out, row_out, config=cfg, init_method=init, bias=bias,
                                     input_is_parallel=True, skip_bias_add=False)
        if fp8:
            # Odd sizes (uneven shards) are outside the GEMM shape rule that the converter
            # enforces for CUDA; CPU GEMMs and the all-gather take any shape.
            for layer in (self.col, self.row):
                to_fp8_linear(layer, Fp8Recipe(format="hybrid", recipe="tensorwise"), check_shape=False)

    def forward(self, x):
        return self.row(self.col(x)[0])[0]


def _build(layout, *, bias=True, fp8=True, meta=False):
    _, tp, ps_kwargs, col_out, row_out = LAYOUTS[layout]
    if parallel_state.model_parallel_is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    else:
        setup_parallel(tp, seed=SEED, **ps_kwargs)
    cfg = make_config(tensor_model_parallel_size=tp)
    with torch.device("meta") if meta else torch.device("cpu"):
        net = _Net(cfg, col_out, row_out, bias=bias, fp8=fp8)
    mesh = (parallel_state.get_hybrid_data_parallel_mesh() if ps_kwargs.get("num_distributed_optimizer_instances")
            else parallel_state.get_data_parallel_mesh())
    return net, mesh


def _shard(net, mesh, reshard=True, mp=BF16):
    for unit in (net.col, net.row, net):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)


def _full_masters(net) -> dict:
    """The full master weights, through the state dict (plain tensors there)."""
    state = net.state_dict()
    for key in ("col.weight", "row.weight"):
        local = _torch_compat.local_tensor(state[key])
        assert type(local) is torch.Tensor, f"{key}: the state dict holds a {type(local).__name__}"
    return {key: full_tensor(state[key]).clone() for key in ("col.weight", "row.weight")}


def _expected_fp8(full: torch.Tensor, tp_dim: int):
    """This rank's TP part of `full` cast to e4m3 with the scale of the whole
    weight, computed here: 448 / amax in float64, float32, clamp, cast."""
    scale = torch.tensor(448.0 / float(full.abs().max()), dtype=torch.float64).float()
    tp, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank())
    local = full.chunk(tp, dim=tp_dim)[rank]
    return (local.float() * scale).clamp(-448.0, 448.0).to(E4M3), scale


def _check_gathered(net, masters) -> None:
    for unit in (net.col, net.row):
        unit.unshard()
    for key, layer, tp_dim in (("col.weight", net.col, 0), ("row.weight", net.row, 1)):
        weight = layer.weight
        local = _torch_compat.local_tensor(weight)
        assert isinstance(local, Fp8GatheredWeight), f"{key}: gathered a {type(local).__name__}"
        assert local.dtype == torch.bfloat16 and local._data.dtype == E4M3
        expected, scale = _expected_fp8(masters[key], tp_dim)
        assert torch.equal(local._data.view(torch.uint8), expected.view(torch.uint8)), f"{key}: fp8 bytes differ"
        assert torch.equal(local._scale, scale), f"{key}: scale {local._scale} != {scale}"
    for unit in (net.col, net.row):
        unit.reshard()


def _batch(step):
    return torch.randn(4, 2, IN_FEATURES, generator=torch.Generator().manual_seed(100 + step)).to(torch.bfloat16)


def _case_round_trip(layout, reshard):
    net, mesh = _build(layout)
    masters = {k: full_tensor(v.detach()).clone() for k, v in net.state_dict().items() if k.endswith("weight")}
    assert convert_to_fp8_weights(net) == 2
    assert net.col.weight.tensor_model_parallel and net.col.weight.partition_dim == 0
    assert net.row.weight.partition_dim == 1
    _shard(net, mesh, reshard)
    refresh_fp8_scales(net)
    net(_batch(0))  # FSDP's lazy initialization runs from the root
    _check_gathered(net, masters)
    sharded = _full_masters(net)
    assert all(torch.equal(sharded[k], masters[k]) for k in masters), "conversion changed the weights"
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    col_outputs = []
    net.col.register_forward_hook(lambda module, args, output: col_outputs.append(output[0].detach()))
    for step in range(3):
        x = _batch(step)
        net(x).float().square().mean().backward()  # the first forward goes through the root
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            # The forward GEMM read the weights of this step (not a stale gather).
            w_fp8, w_scale = _expected_fp8(masters["col.weight"], 0)
            x_scale = torch.tensor(448.0 / float(x.abs().max()), dtype=torch.float64).float()
            x_fp8 = (x.float() * x_scale).clamp(-448.0, 448.0).to(E4M3)
            expected = (x_fp8.double() / x_scale.double()) @ (w_fp8.double() / w_scale.double()).t()
            expected = expected + full_tensor(net.col.bias.detach()).double()
            torch.testing.assert_close(col_outputs[-1].double(), expected, rtol=1e-2, atol=1e-3)
        opt.step()
        opt.zero_grad()
        refresh_fp8_scales(net)
        new = _full_masters(net)
        assert not torch.equal(new["col.weight"], masters["col.weight"]), "the step did not change the weight"
        masters = new
        _check_gathered(net, masters)
    assert is_fp8_training_weight(net.col.weight)


class _CountCasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func.overloadpacket.__name__ == "cast_to_fp8"
        return func(*args, **(kwargs or {}))


def _case_one_cast_per_step():
    """Two microbatches, resharded after forward: four all-gathers of each weight per step,
    one cast of each (issue 20: weights change only at the optimizer step)."""
    net, mesh = _build("dp2_even")
    convert_to_fp8_weights(net)
    _shard(net, mesh, reshard=True)
    refresh_fp8_scales(net)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    casts = []
    for step in range(2):
        with _CountCasts() as mode:
            for micro in range(2):
                net(_batch(2 * step + micro)).float().square().mean().backward()
        casts.append(mode.casts)
        opt.step()
        opt.zero_grad()
        refresh_fp8_scales(net)
    masters = _full_masters(net)
    _check_gathered(net, masters)  # and the bytes sent after the last step are that step's weights
    return casts


def test_each_fp8_weight_is_cast_once_per_step(pools):
    for casts in pools(2).run(_case_one_cast_per_step):
        assert casts == [2, 2], casts  # col and row, whatever the number of all-gathers


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("reshard", [True, False])
def test_gathered_fp8_weight_is_the_cast_full_weight_and_follows_each_step(pools, layout, reshard):
    pools(LAYOUTS[layout][0]).run(_case_round_trip, layout, reshard)


def _case_all_gather_bytes(fp8, bias):
    net, mesh = _build("dp2_even", bias=bias)
    if fp8:
        convert_to_fp8_weights(net)
    _shard(net, mesh)
    if fp8:
        refresh_fp8_scales(net)
    sent = []
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor")
                 if hasattr(dist, name)}

    def counting(original):
        def collective(output, input, *args, **kwargs):
            sent.append(input.numel() * input.element_size())
            return original(output, input, *args, **kwargs)
        return collective

    for name, original in originals.items():
        setattr(dist, name, counting(original))
    try:
        net(_batch(0)).float().sum().backward()  # forward gathers, backward gathers again
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return sent


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_all_gather_moves_half_the_bytes_of_bf16(pools, bias):
    pool = pools(2)
    bf16 = pool.run(_case_all_gather_bytes, False, bias)[0]
    fp8 = pool.run(_case_all_gather_bytes, True, bias)[0]
    assert len(bf16) == len(fp8) == 4, (bf16, fp8)  # two units, forward and backward
    # Per rank: column weight 64x32/2, row weight 32x64/2; biases 64/2 and 32/2, in bf16 in both runs.
    weights = [1024, 1024, 1024, 1024]  # the column unit, the row unit, then the row and column units again
    biases = [32, 16, 16, 32] if bias else [0] * 4
    assert bf16 == [2 * w + 2 * b for w, b in zip(weights, biases)]
    assert fp8 == [w + 2 * b for w, b in zip(weights, biases)]  # weights at one byte; nothing else travels
    if not bias:
        assert [2 * f for f in fp8] == bf16


def _case_meta_device(layout):
    # The reference: the same net built on meta without fp8 weights, initialized from the same seed.
    plain, mesh = _build(layout, meta=True)
    _shard(plain, mesh)
    plain.to_empty(device="cpu")
    initialize_parameters(plain, seed=SEED)
    expected = _full_masters(plain)
    net, mesh = _build(layout, meta=True)
    assert convert_to_fp8_weights(net) == 2 and net.col.weight.is_meta
    _shard(net, mesh)
    net.to_empty(device="cpu")
    initialize_parameters(net, seed=SEED)
    refresh_fp8_scales(net)
    assert is_fp8_training_weight(net.col.weight) and is_fp8_training_weight(net.row.weight)
    masters = _full_masters(net)
    for key in expected:
        assert torch.equal(masters[key], expected[key]), key
    net(_batch(0)).float().sum().backward()
    _check_gathered(net, masters)


@pytest.mark.parametrize("layout", ["dp2_uneven", "dp2_tp2_uneven"])
def test_meta_device_model_converts_before_materialization(pools, layout):
    pools(LAYOUTS[layout][0]).run(_case_meta_device, layout)


def _case_bad_combination(case):
    setup_parallel(1)
    gather = SimpleNamespace(fp8_param_gather=True)
    if case == "no_fp8":
        check_fp8_param_gather(make_config(), gather, True)
    elif case == "int_reshard":
        check_fp8_param_gather(make_config(fp8="hybrid"), gather, 2)
    elif case == "fp8_param_alone":
        check_fp8_param_gather(make_config(fp8="hybrid", fp8_param=True), SimpleNamespace(fp8_param_gather=False),
                               True)
    elif case == "after_fully_shard":
        net, mesh = _build("dp2_even")
        _shard(net, mesh)
        convert_to_fp8_weights(net)
    elif case == "no_refresh":
        net, mesh = _build("dp2_even")
        convert_to_fp8_weights(net)
        _shard(net, mesh)
        net(_batch(0))


@pytest.mark.parametrize("case,error,match", [
    ("no_fp8", "ValueError", "fp8_param_gather=True needs fp8 training"),
    ("int_reshard", "NotImplementedError", "reshard_after_forward=2 is not supported"),
    ("fp8_param_alone", "ValueError", "fp8_param=True needs DistributedDataParallelConfig"),
    ("after_fully_shard", "ValueError", "must run before fully_shard"),
    ("no_refresh", "RuntimeError", "fp8 weight has no scale yet: call megatron_fsdp.fp8.refresh_fp8_scales"),
])
def test_bad_combinations_raise_on_every_rank(pools, case, error, match):
    errors = pools(2).run_expecting_errors(_case_bad_combination, case, timeout=60)
    for e in errors:
        assert e.type_name == error and match in e.message, (e.type_name, e.message)
