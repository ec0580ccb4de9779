"""TorchFullyShardedDataParallel against a dense single-process reference."""

import contextlib
import math
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import reference_gpt
from helpers import FP32_TOLERANCE, assert_close_dicts, full_params, make_config, setup_parallel, tiered
from megatron_fsdp import _torch_compat, parallel_state
from megatron_fsdp.distributed import (
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
import megatron_fsdp.initialization as init_module
from megatron_fsdp.initialization import initialize_parameters
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.utils import register_weights_changed_hook

STEPS = 3
LR = 1e-2
# The key bias gets an exactly-zero gradient (softmax ignores it), so its
# computed gradient is rounding noise; Adam's default eps=1e-8 would blow that
# noise up to a full step. A larger eps keeps the comparison meaningful.
ADAM = dict(lr=LR, eps=1e-5)
SEQ = 16
MICRO = 2

LAYOUTS = {
    # name: (world size, tp, parallel_state kwargs, ddp_config kwargs, wrapper kwargs)
    "dp2_zero3": (2, 1, {}, dict(reshard_after_forward=True), {}),
    "dp4_zero3": (4, 1, {}, dict(reshard_after_forward=True), {}),
    "dp4_zero2": (4, 1, {}, dict(reshard_after_forward=False), {}),
    "dp4_reshard_to_2": (4, 1, {}, dict(reshard_after_forward=2), {}),
    "dp4_one_unit": (4, 1, {}, {}, dict(disable_bucketing=True)),
    "tp2_dp2_sequence_parallel": (4, 2, {}, {}, {}),
    "hsdp_2x2": (4, 1, dict(num_distributed_optimizer_instances=2), dict(num_distributed_optimizer_instances=2), {}),
}

MODELS = {
    "plain": (dict(), dict()),
    # 66 rows, hidden 36, ffn 50: the vocabulary rows and fc2's columns divide unevenly over 4 ranks.
    # SwiGLU: fc1 holds [gate_r; up_r] per TP rank (partition_stride 2).
    "uneven": (dict(hidden_size=36, num_attention_heads=4, ffn_hidden_size=50, gated_linear_unit=True,
                    activation_func=F.silu), dict(vocab_size=66)),
    "tied_rope": (dict(), dict(share_embeddings_and_output_weights=True, position_embedding_type="rope")),
    # Recompute re-runs forwards inside backward; the wrapper sets explicit backward prefetch.
    "recompute": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), dict()),
}


def _global_batch(dp_size, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (STEPS, dp_size * MICRO, SEQ), generator=g)
    labels = torch.randint(0, vocab, (STEPS, dp_size * MICRO, SEQ), generator=g)
    return ids, labels


def _reference_training(params, cfg, model_kwargs, ids, labels):
    """Dense full-batch AdamW on a copy of the initial full weights."""
    ref = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    opt = torch.optim.AdamW(ref.values(), **ADAM)
    losses = []
    for step in range(STEPS):
        loss = reference_gpt.gpt_forward(
            ref, cfg, ids[step], labels[step],
            position_embedding_type=model_kwargs.get("position_embedding_type", "learned_absolute"),
            tied=model_kwargs.get("share_embeddings_and_output_weights", False)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in ref.items()}


def _build(tp, model_name, ps_kwargs, ddp_kwargs, wrapper_kwargs, *, meta=False, bf16=False):
    setup_parallel(tp, **ps_kwargs)
    cfg_kwargs, model_kwargs = MODELS[model_name]
    cfg = make_config(sequence_parallel=tp > 1, bf16=bf16, **cfg_kwargs)
    model_kwargs = dict(dict(vocab_size=64, max_sequence_length=SEQ), **model_kwargs)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPTModel(cfg, **model_kwargs)
    ddp_config = TorchFullyShardedDataParallelConfig(**ddp_kwargs)
    return cfg, model_kwargs, TorchFullyShardedDataParallel(cfg, ddp_config, model, **wrapper_kwargs)


def _train_sharded(wrapped, ids, labels):
    dp_rank = parallel_state.get_data_parallel_rank()
    opt = torch.optim.AdamW(wrapped.parameters(), **ADAM)
    losses = []
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    for step in range(STEPS):
        rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
        loss = wrapped(ids[step, rows], positions, None, labels=labels[step, rows]).float().mean()
        loss.backward()
        wrapped.finish_grad_sync()
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=parallel_state.get_data_parallel_group())
        losses.append(reported.item() / parallel_state.get_data_parallel_world_size())
    return losses


def _case_training_parity(layout, model_name, meta=False, bf16=False):
    _, tp, ps_kwargs, ddp_kwargs, wrapper_kwargs = LAYOUTS[layout]
    cfg, model_kwargs, wrapped = _build(tp, model_name, ps_kwargs, ddp_kwargs, wrapper_kwargs, meta=meta, bf16=bf16)
    initial = full_params(wrapped.module)
    ids, labels = _global_batch(parallel_state.get_data_parallel_world_size(), model_kwargs["vocab_size"])
    ref_losses, ref_params = _reference_training(initial, cfg, model_kwargs, ids, labels)
    losses = _train_sharded(wrapped, ids, labels)
    if bf16:
        # bf16 compute, fp32 master weights and reduction: agreement to bf16 precision.
        # Adam turns bf16 rounding on near-zero gradients into whole +-lr steps,
        # so compare the update as a whole: within 10% of the fp32 update.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
        got = full_params(wrapped.module)
        update_error = torch.cat([(got[n] - ref_params[n]).reshape(-1) for n in ref_params]).norm()
        update = torch.cat([(ref_params[n] - initial[n]).reshape(-1) for n in ref_params]).norm()
        assert update_error < 0.1 * update, f"bf16 update differs by {update_error / update:.1%} from fp32"
        assert all(p.dtype == torch.float32 for p in wrapped.parameters()), "master weights must stay fp32"
    else:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **FP32_TOLERANCE)
        assert_close_dicts(full_params(wrapped.module), ref_params, "updated weight")
    return initial


# ZeRO-3, TP x FSDP with sequence parallelism and HSDP in the fast loop; the other layouts in the suite.
@pytest.mark.parametrize("layout", tiered(list(LAYOUTS), ["dp4_zero3", "tp2_dp2_sequence_parallel", "hsdp_2x2"]))
def test_training_matches_dense_reference(pools, layout):
    pools(LAYOUTS[layout][0]).run(_case_training_parity, layout, "plain")


@pytest.mark.parametrize("model_name", tiered(["uneven", "tied_rope", "recompute"], ["uneven"]))
@pytest.mark.parametrize("layout", tiered(["dp4_zero3", "tp2_dp2_sequence_parallel"], ["dp4_zero3"]))
def test_training_matches_for_uneven_and_tied_models(pools, layout, model_name):
    pools(4).run(_case_training_parity, layout, model_name)


@pytest.mark.slow  # a grid of pool cases; a representative runs in the fast loop
def test_bf16_training_matches_within_bf16_precision(pools):
    pools(4).run(_case_training_parity, "tp2_dp2_sequence_parallel", "plain", bf16=True)


def _case_reduce_dtype(grad_reduce_in_fp32):
    *_, wrapped = _build(1, "plain", {}, dict(grad_reduce_in_fp32=grad_reduce_in_fp32), {}, bf16=True)
    ids = torch.randint(0, 64, (MICRO, SEQ), generator=torch.Generator().manual_seed(2))
    with _CountCollectives() as seen:
        wrapped(ids, torch.arange(SEQ).expand(MICRO, SEQ), None, labels=ids).float().mean().backward()
    expected = torch.float32 if grad_reduce_in_fp32 else torch.bfloat16
    assert seen.reduce_scatters > 0 and seen.reduce_dtypes == {expected}, (
        f"reduce-scatter dtypes {seen.reduce_dtypes}, expected {expected}")
    assert all(p.grad.dtype == torch.float32 for p in wrapped.parameters()), "sharded gradients must be fp32"


@pytest.mark.parametrize("grad_reduce_in_fp32", [False, True])
def test_grad_reduce_in_fp32_selects_reduce_dtype(pools, grad_reduce_in_fp32):
    pools(4).run(_case_reduce_dtype, grad_reduce_in_fp32)


def _case_micro_batch_of_one(model_name):
    """With one sequence per micro-batch the embedding's output, the loss and the logits are
    tensors of their own, not views (Megatron's transpose(0, 1).contiguous() of a dim of size 1 is
    one): FSDP2 warns on every rank about a wrapped module's view outputs."""
    import warnings

    *_, wrapped = _build(1, model_name, {}, {}, {})
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = wrapped(ids, torch.arange(SEQ)[None], None, labels=ids)
        loss.sum().backward()
        with torch.no_grad():
            logits = wrapped(ids, torch.arange(SEQ)[None], None)
    assert loss.shape == (1, SEQ) and logits.shape == (1, SEQ, 64)
    assert not loss._is_view() and not logits._is_view() and logits.is_contiguous()
    assert not [w for w in seen if "view" in str(w.message)], [str(w.message) for w in seen]


@pytest.mark.parametrize("model_name", ["plain", "tied_rope"])
def test_a_micro_batch_of_one_gives_outputs_that_are_not_views(pools, model_name):
    pools(2).run(_case_micro_batch_of_one, model_name)


def _case_broadcast_params_hsdp():
    _, tp, ps_kwargs, ddp_kwargs, wrapper_kwargs = LAYOUTS["hsdp_2x2"]
    *_, wrapped = _build(tp, "plain", ps_kwargs, ddp_kwargs, wrapper_kwargs)
    expected = full_params(wrapped.module)
    if dist.get_rank() >= 2:  # the second replica drifts
        with torch.no_grad():
            for p in wrapped.parameters():
                p.to_local().add_(1.0)
    seen = []  # state derived from the weights (the fp8 converter's scales) follows them
    register_weights_changed_hook(wrapped.module.decoder, "probe", lambda: seen.append(full_params(wrapped.module)))
    wrapped.broadcast_params()
    assert_close_dicts(full_params(wrapped.module), expected, "after broadcast_params", rtol=0, atol=0)
    assert len(seen) == 1, "broadcast_params runs the model's weights-changed hooks once"
    assert_close_dicts(seen[0], expected, "weights the hook saw", rtol=0, atol=0)


def test_broadcast_params_aligns_hsdp_replicas(pools):
    pools(4).run(_case_broadcast_params_hsdp)


def _case_meta_device_init(layout, model_name):
    _, tp, ps_kwargs, ddp_kwargs, wrapper_kwargs = LAYOUTS[layout]
    # The same full weights however the model is laid out: sharded over this layout, or one
    # whole copy per rank (TP=1, no wrapper), from the same seed (setup_parallel seeds torch's
    # generator, initialize_parameters takes its seed from it); each rank drew only its part.
    drawn, whole_tensor_draw = [], init_module.init_full_tensor
    init_module.init_full_tensor = lambda shape, *args: drawn.append(shape) or whole_tensor_draw(shape, *args)
    try:
        *_, materialized = _build(tp, model_name, ps_kwargs, ddp_kwargs, wrapper_kwargs, meta=True)
    finally:
        init_module.init_full_tensor = whole_tensor_draw
    assert not drawn, f"full tensors drawn: {drawn}"  # Megatron's init methods: each rank its slice only
    assert all(p.device.type == "cpu" for p in materialized.parameters())
    sharded = full_params(materialized.module)
    parallel_state.destroy_model_parallel()
    setup_parallel(1)
    cfg_kwargs, model_kwargs = MODELS[model_name]
    with torch.device("meta"):
        whole = GPTModel(make_config(**cfg_kwargs),
                         **dict(dict(vocab_size=64, max_sequence_length=SEQ), **model_kwargs))
    whole.to_empty(device="cpu")
    initialize_parameters(whole)  # the seed: one draw from the generator setup_parallel seeded
    assert_close_dicts(sharded, full_params(whole), "meta-initialized weight", rtol=0, atol=0)
    # Megatron's distributions: N(0, init_method_std) weights (the output projections scaled
    # by 1/sqrt(2 num_layers)), unit norm weights, zero biases.
    cfg = make_config(**cfg_kwargs)
    for name, value in sharded.items():
        if name.endswith(".bias"):
            assert not value.any(), name
        elif "layernorm" in name:
            assert torch.equal(value, torch.ones_like(value)), name
        elif value.numel() > 1000:
            std = cfg.init_method_std / (math.sqrt(2 * cfg.num_layers) if name.endswith(("linear_proj.weight",
                                                                                          "linear_fc2.weight")) else 1)
            assert abs(float(value.std()) / std - 1) < 0.05 and abs(float(value.mean())) < 0.1 * std, name
    parallel_state.destroy_model_parallel()
    _case_training_parity(layout, model_name, meta=True)


@pytest.mark.parametrize("layout,model_name", [("dp4_zero3", "tied_rope"), ("tp2_dp2_sequence_parallel", "uneven")])
@pytest.mark.slow  # pool cases; meta init's representative: test_fully_shard.py
def test_meta_device_init_is_the_same_at_every_layout(pools, layout, model_name):
    pools(4).run(_case_meta_device_init, layout, model_name)


def _case_parameters_are_2d_dtensors():
    *_, wrapped = _build(2, "plain", {}, {}, {})
    fc1 = wrapped.module.decoder.layers[0].mlp.linear_fc1.weight
    assert fc1.device_mesh.mesh_dim_names == ("dp_cp", "tp")
    assert fc1.placements[1].is_shard(0)
    norm = wrapped.module.decoder.layers[0].input_layernorm.weight
    assert norm.device_mesh.mesh_dim_names == ("dp_cp",)
    # Optimizer state and gradients are sharded like the parameters: 1/DP of a TP shard.
    assert fc1.to_local().numel() == fc1.numel() // 4
    # Megatron's per-parameter TP attributes survive sharding, meta
    # materialization, and the fp32 cast of master weights under bf16.
    for variant in ("normal", "meta", "bf16"):
        if variant != "normal":
            parallel_state.destroy_model_parallel()
            *_, wrapped = _build(2, "plain", {}, {}, {}, meta=variant == "meta", bf16=variant == "bf16")
        layer = wrapped.module.decoder.layers[0]
        assert (layer.mlp.linear_fc1.weight.tensor_model_parallel, layer.mlp.linear_fc1.weight.partition_dim) == (True, 0)
        assert layer.self_attention.linear_proj.weight.partition_dim == 1
        assert layer.self_attention.linear_proj.bias.tensor_model_parallel is False
        assert not hasattr(layer.input_layernorm.weight, "tensor_model_parallel")


def test_parameters_are_2d_dp_tp_dtensors(pools):
    pools(4).run(_case_parameters_are_2d_dtensors)


class _CountCollectives:
    """Counts FSDP2's all-gathers (with their group sizes) and reduce-scatters
    (with their input dtypes)."""

    gathers = ("all_gather_single", "all_gather_into_tensor")
    scatters = ("reduce_scatter_single", "reduce_scatter_tensor")

    def __enter__(self):
        self.all_gathers, self.reduce_scatters, self.reduce_dtypes = [], 0, set()
        self.saved = {n: getattr(dist, n) for n in self.gathers + self.scatters if hasattr(dist, n)}
        for name, fn in self.saved.items():
            gather = name in self.gathers

            def counting(output, input, *args, _fn=fn, _gather=gather, **kwargs):
                if _gather:
                    self.all_gathers.append(dist.get_world_size(kwargs.get("group")))
                else:
                    self.reduce_scatters += 1
                    self.reduce_dtypes.add(input.dtype)
                return _fn(output, input, *args, **kwargs)
            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


ACCUMULATION_MODES = {
    # name: ddp_config kwargs
    "sharded": {},  # the default: no_sync is Megatron-Core's no-op
    "unsharded": dict(accumulate_unsharded_grads_in_no_sync=True),
}


def _unsharded_grad_bytes(wrapped):
    """Walks FSDP2's state apart from the wrapper's own accounting."""
    held = 0
    for m in wrapped.module.modules():
        if isinstance(m, FSDPModule):
            for group in _torch_compat.fsdp_param_groups(m):
                for fp in group.fsdp_params:
                    for g in (fp.unsharded_accumulated_grad, getattr(getattr(fp, "_unsharded_param", None), "grad", None)):
                        if g is not None:
                            g = g.to_local() if isinstance(g, DTensor) else g
                            held += g.numel() * g.element_size()
    return held


def _case_gradient_accumulation(tp, mode, bf16=False, microbatches=3):
    ddp_kwargs = dict(ACCUMULATION_MODES[mode], grad_reduce_in_fp32=bf16)
    cfg, model_kwargs, wrapped = _build(tp, "plain", {}, ddp_kwargs, {}, bf16=bf16)
    units = len(wrapped.fsdp_units) + 1
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (microbatches, dp * MICRO, SEQ), generator=g)
    labels = torch.randint(0, 64, (microbatches, dp * MICRO, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
    reference = {n: p.clone().requires_grad_(True) for n, p in full_params(wrapped.module).items()}
    reference_gpt.gpt_forward(reference, cfg, ids.reshape(-1, SEQ), labels.reshape(-1, SEQ)).mean().backward()

    held = []
    with _CountCollectives() as seen:
        for i in range(microbatches):
            last = i == microbatches - 1
            with contextlib.nullcontext() if last else wrapped.no_sync():
                loss = wrapped(ids[i, rows], positions, None, labels=labels[i, rows]).float().mean()
                (loss / microbatches).backward()
            if not last:
                held.append(_unsharded_grad_bytes(wrapped))
                reported = wrapped.unsharded_grad_bytes() if hasattr(wrapped, "unsharded_grad_bytes") else None
    wrapped.finish_grad_sync()
    if mode == "sharded":
        assert seen.reduce_scatters == units * microbatches, (
            f"one reduce-scatter per unit per microbatch expected: saw {seen.reduce_scatters}, "
            f"{units} units x {microbatches} microbatches")
        assert held == [0] * (microbatches - 1), f"unsharded gradient bytes held between microbatches: {held}"
    else:
        assert seen.reduce_scatters == units, (
            f"only the last microbatch may reduce-scatter, once per unit: saw {seen.reduce_scatters}")
        # One fp32 gradient per element of this rank's TP shard of every parameter.
        tp_local = sum(p.numel() // (tp if getattr(p, "tensor_model_parallel", False) else 1)
                       for p in wrapped.parameters())
        assert held == [4 * tp_local] * (microbatches - 1), f"held {held}, expected {4 * tp_local} bytes"
    assert reported == held[-1], f"unsharded_grad_bytes() reports {reported}, FSDP holds {held[-1]}"
    # bf16 compute with grad_reduce_in_fp32: fp32 reduce-scatters into fp32 shards.
    assert seen.reduce_dtypes == {torch.float32}, seen.reduce_dtypes
    assert all(p.grad.dtype == torch.float32 for p in wrapped.parameters())
    got = {n: p.grad.full_tensor() for n, p in wrapped.module.named_parameters()}
    expected = {n: p.grad for n, p in reference.items()}
    if bf16:
        error = torch.cat([(got[n] - expected[n]).reshape(-1) for n in expected]).norm()
        norm = torch.cat([e.reshape(-1) for e in expected.values()]).norm()
        assert error < 0.05 * norm, f"bf16 gradient differs by {error / norm:.1%} from the fp32 reference"
    else:
        assert_close_dicts(got, expected, "accumulated gradient")

    # Every backward inside no_sync: only the unsharded mode leaves gradients unreduced.
    wrapped.zero_grad_buffer()
    assert _unsharded_grad_bytes(wrapped) == 0 and all(p.grad is None for p in wrapped.parameters())
    with wrapped.no_sync():
        wrapped(ids[0, rows], positions, None, labels=labels[0, rows]).float().mean().backward()
    if mode == "sharded":
        wrapped.finish_grad_sync()
        assert all(p.grad is not None for p in wrapped.parameters())
    else:
        with pytest.raises(RuntimeError, match="every backward ran inside no_sync"):
            wrapped.finish_grad_sync()
        wrapped.zero_grad_buffer()
        assert _unsharded_grad_bytes(wrapped) == 0
    return got


@pytest.mark.parametrize("tp,bf16", tiered([(1, False), (2, False), (2, True)], [(1, False)]))
def test_gradient_accumulation_modes_agree_with_the_reference(pools, tp, bf16):
    sharded = pools(4).run(_case_gradient_accumulation, tp, "sharded", bf16)[0]
    unsharded = pools(4).run(_case_gradient_accumulation, tp, "unsharded", bf16)[0]
    # Same per-microbatch gradients, summed in another order: fp32 reordering apart.
    assert_close_dicts(sharded, unsharded, "sharded vs unsharded accumulation")


def _case_abandoned_accumulation(mode):
    *_, wrapped = _build(1, "plain", {}, ACCUMULATION_MODES[mode], {})
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (MICRO, SEQ), generator=g)
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    wrapped(ids, positions, None, labels=ids).mean().backward()
    expected = {n: p.grad.full_tensor() for n, p in wrapped.module.named_parameters()}
    wrapped.zero_grad_buffer()
    with wrapped.no_sync():  # an accumulation that is abandoned
        wrapped(ids.flip(0), positions, None, labels=ids).mean().backward()
    wrapped.zero_grad_buffer()
    wrapped(ids, positions, None, labels=ids).mean().backward()
    wrapped.finish_grad_sync()
    got = {n: p.grad.full_tensor() for n, p in wrapped.module.named_parameters()}
    assert_close_dicts(got, expected, "gradient after an abandoned no_sync accumulation")


@pytest.mark.parametrize("mode", list(ACCUMULATION_MODES))
@pytest.mark.slow  # pool cases; accumulation's representative: above
def test_zero_grad_buffer_drops_abandoned_accumulation(pools, mode):
    pools(4).run(_case_abandoned_accumulation, mode)


def test_accumulation_mode_must_be_a_bool():
    with pytest.raises(ValueError, match="accumulate_unsharded_grads_in_no_sync must be True or False, got 'yes'"):
        TorchFullyShardedDataParallelConfig(accumulate_unsharded_grads_in_no_sync="yes")


def _case_helpers():
    *_, wrapped = _build(2, "plain", {}, dict(check_for_nan_in_grad=True), {})
    ids = torch.randint(0, 64, (MICRO, SEQ), generator=torch.Generator().manual_seed(1))
    wrapped(ids, torch.arange(SEQ).expand(MICRO, SEQ), None, labels=ids).mean().backward()
    wrapped.finish_grad_sync()
    before = {n: p.grad.full_tensor() for n, p in wrapped.module.named_parameters()}
    wrapped.scale_gradients(0.5)
    for n, p in wrapped.module.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), before[n] * 0.5)
    # A non-finite gradient shard on one rank: check_for_nan_in_grad raises on every rank.
    if dist.get_rank() == 1:
        next(wrapped.parameters()).grad.to_local().view(-1)[0] = float("nan")
    expected = "this rank's shards of ['embedding" if dist.get_rank() == 1 else "shards held by other ranks"
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        wrapped.finish_grad_sync()
    wrapped.zero_grad_buffer()
    assert all(p.grad is None for p in wrapped.parameters())

    # broadcast_params and state dicts round-trip the sharded weights.
    state = {k: v.full_tensor().clone() for k, v in wrapped.state_dict().items()}
    with torch.no_grad():
        for p in wrapped.parameters():
            p.zero_()
    wrapped.load_state_dict(state)
    for k, v in wrapped.state_dict().items():
        torch.testing.assert_close(v.full_tensor(), state[k], rtol=0, atol=0)
    wrapped.broadcast_params()
    assert wrapped.state_dict_for_save_checkpoint().keys() == state.keys()


@pytest.mark.slow  # a pool case
def test_megatron_interface_helpers(pools):
    pools(4).run(_case_helpers)


def _case_gloo_sum_reduction():
    *_, wrapped = _build(1, "plain", {}, {}, {})
    fsdp_modules = [m for m in wrapped.module.modules() if isinstance(m, FSDPModule)]
    assert len(fsdp_modules) == len(wrapped.fsdp_units) + 1
    groups = [g for m in fsdp_modules for g in _torch_compat.fsdp_param_groups(m)]
    assert groups and all(g.force_sum_reduction_for_comms for g in groups), (
        f"{sum(not g.force_sum_reduction_for_comms for g in groups)} of {len(groups)} FSDP param groups "
        "would reduce with AVG/PREMUL_SUM")
    ids = torch.randint(0, 64, (MICRO, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    positions = torch.arange(SEQ).expand(MICRO, SEQ)
    wrapped(ids, positions, None, labels=ids).mean().backward()
    mean = {n: p.grad.full_tensor() for n, p in wrapped.module.named_parameters()}
    wrapped.zero_grad_buffer()
    # A divide factor other than the group size makes FSDP2 reduce with
    # PREMUL_SUM, which gloo rejects, in every unit that is not forced to SUM.
    for m in fsdp_modules:
        m.set_gradient_divide_factor(1.0)
    wrapped(ids, positions, None, labels=ids).mean().backward()
    summed = {n: p.grad.full_tensor() for n, p in wrapped.module.named_parameters()}
    assert_close_dicts(summed, {n: g * dist.get_world_size() for n, g in mean.items()}, "summed gradient")


@pytest.mark.slow  # a pool case
def test_gloo_reductions_are_sums_in_every_unit(pools):
    pools(4).run(_case_gloo_sum_reduction)



def _case_collectives_per_step(layout):
    _, tp, ps_kwargs, ddp_kwargs, wrapper_kwargs = LAYOUTS[layout]
    *_, wrapped = _build(tp, "plain", ps_kwargs, ddp_kwargs, wrapper_kwargs)
    ids = torch.randint(0, 64, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    with _CountCollectives() as forward:
        loss = wrapped(ids, torch.arange(SEQ).expand(MICRO, SEQ), None, labels=ids).mean()
    with _CountCollectives() as backward:
        loss.backward()
        wrapped.finish_grad_sync()
    return len(wrapped.fsdp_units) + 1, forward.all_gathers, backward.all_gathers, backward.reduce_scatters


@pytest.mark.slow  # a pool case
def test_collectives_per_step_follow_the_resharding_mode(pools):
    units, fwd, bwd, rs = pools(4).run(_case_collectives_per_step, "dp4_zero3")[0]
    # ZeRO-3: every unit gathers in forward, re-gathers in backward (the root
    # stays gathered), and reduce-scatters its gradients once.
    assert (len(fwd), len(bwd), rs) == (units, units - 1, units) and set(fwd + bwd) == {4}
    _, fwd2, bwd2, rs2 = pools(4).run(_case_collectives_per_step, "dp4_zero2")[0]
    assert (len(fwd2), len(bwd2), rs2) == (units, 0, units)  # ZeRO-2: nothing re-gathered
    _, fwd_int, bwd_int, rs_int = pools(4).run(_case_collectives_per_step, "dp4_reshard_to_2")[0]
    # Resharded to groups of 2 after forward (the root too): backward gathers
    # within those groups only.
    assert len(bwd_int) == units and set(bwd_int) == {2} and set(fwd_int) == {4} and rs_int == units
    _, fwd1, bwd1, rs1 = pools(4).run(_case_collectives_per_step, "dp4_one_unit")[0]
    assert (len(fwd1), len(bwd1), rs1) == (1, 0, 1)  # disable_bucketing: one of each per step
