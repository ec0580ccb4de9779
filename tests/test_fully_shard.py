"""NVIDIA Megatron-FSDP's `fully_shard` API on FSDP2, for models that are not ours (a small CNN, a
`torch.nn.TransformerEncoderLayer` stack), on gloo worker processes.

The reference is one process training the same model (same seed) on every rank's data, with
SGD and momentum (Adam turns rounding noise in zero gradients into lr-sized steps): after a few
steps every rank's full parameters equal it within 1e-5."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import megatron_fsdp
from helpers import tiered
from megatron_fsdp import MixedPrecisionPolicy, fully_shard, fully_shard_model, fully_shard_optimizer

from fully_shard_models import (STEPS, EncoderStack, SmallCNN, adam_run, assert_like_one_process, batch, gathered,
                                loss_of, train_like_one_process)

def _case_training_matches_reference(model_name, strategy, **kwargs):
    model, _ = train_like_one_process(model_name, strategy, **kwargs)
    sharded = [p for p in model.module.parameters() if p.to_local().numel() < p.numel()]
    return model.data_parallel_sharding_strategy, model.device_mesh.ndim, bool(sharded)


@pytest.mark.parametrize("model_name, strategy, expected", [
    # Each strategy once in the fast loop (by number on the CNN, by name on the encoder), the rest in the suite.
    ("cnn", 0, ("no_shard", 2, False)), ("cnn", 1, ("optim", 1, True)),
    pytest.param("cnn", 2, ("optim_grads", 1, True), marks=pytest.mark.slow),
    pytest.param("cnn", 3, ("optim_grads_params", 1, True), marks=pytest.mark.slow),
    pytest.param("encoder", "no_shard", ("no_shard", 2, False), marks=pytest.mark.slow),
    pytest.param("encoder", "optim", ("optim", 1, True), marks=pytest.mark.slow),
    ("encoder", "optim_grads", ("optim_grads", 1, True)),
    ("encoder", "optim_grads_params", ("optim_grads_params", 1, True)),
])
def test_every_strategy_trains_like_one_process_on_the_whole_batch(pools, model_name, strategy, expected):
    assert pools(4).run(_case_training_matches_reference, model_name, strategy) == [expected] * 4


def _case_accumulation_syncs_once():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = EncoderStack()
    model = fully_shard_model(module, fsdp_unit_modules=[nn.TransformerEncoderLayer],
                              sync_model_each_microbatch=False)
    opt = fully_shard_optimizer(torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    for step in range(STEPS):
        model.set_model_auto_sync(False)
        x, y = batch("encoder", 2 * step, rank)
        loss_of(model, x, y).backward()
        # Not synchronized: nothing reduced, so no sharded gradient yet.
        assert all(p.grad is None for p in model.module.parameters())
        model.set_model_auto_sync(True)
        x, y = batch("encoder", 2 * step + 1, rank)
        loss_of(model, x, y).backward()
        assert all(p.grad is not None for p in model.module.parameters())
        model.finish_grad_sync()  # NVIDIA's loop calls these; on FSDP2 there is nothing left to do
        opt.step()
        model.install_optimized_model_weights()
        model.zero_grad_buffer()
    assert_like_one_process(model, "encoder", world, microbatches=2)


def test_accumulation_with_auto_sync_off_then_on_equals_summed_gradients(pools):
    pools(2).run(_case_accumulation_syncs_once)


def _case_bf16_compute():
    torch.manual_seed(0)
    module = EncoderStack().to(torch.bfloat16)
    model = fully_shard_model(module, fsdp_unit_modules=[nn.TransformerEncoderLayer],
                              mixed_precision_policy=MixedPrecisionPolicy(grad_comm_dtype=torch.float32))
    x, y = batch("encoder", 0, dist.get_rank())
    out = model(x.to(torch.bfloat16))
    nn.functional.cross_entropy(out.float(), y).backward()
    return (out.dtype, {p.dtype for p in model.module.parameters()}, {p.grad.dtype for p in model.module.parameters()})


def test_bf16_compute_keeps_fp32_main_weights_and_gradients(pools):
    assert pools(2).run(_case_bf16_compute) == [(torch.bfloat16, {torch.float32}, {torch.float32})] * 2


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(nccl_ub=True), NotImplementedError, "nccl_ub=True is not supported: FSDP2 has no NCCL user buffers"),
    (dict(fsdp_double_buffer=True), NotImplementedError, "fsdp_double_buffer=True is not supported"),
    (dict(cuda_graph_mode=True), NotImplementedError, "cuda_graph_mode=True is not supported"),
    (dict(expt_device_mesh=object()), TypeError, "expt_device_mesh must be a torch DeviceMesh, got object"),
    (dict(overlap_param_gather=False), ValueError, "overlap_param_gather=False: FSDP2 always overlaps"),
    (dict(zero_dp_strategy=4), ValueError, "zero_dp_strategy=4: choose one of 0 / 'no_shard', 1 / 'optim', "
                                           "2 / 'optim_grads', 3 / 'optim_grads_params'"),
    (dict(zero_dp_strategy="zero3"), ValueError, "zero_dp_strategy='zero3': choose one of"),
    (dict(zero_dp_strategy=True), ValueError, "zero_dp_strategy=True: choose one of"),
    (dict(outer_dp_sharding_strategy=2), ValueError, r"outer_dp_sharding_strategy=2: choose one of 0 / 'no_shard', "
                                                     r"1 / 'optim'$"),
    (dict(outer_dp_sharding_strategy="optim"), ValueError,
     r"outer_dp_sharding_strategy 1 / 'optim' \(HFSDP\) shards the optimizer state across dp_outer_dim: pass a"),
    (dict(outer_dp_sharding_strategy=1, dp_outer_dim="outer", zero_dp_strategy=0), ValueError,
     "zero_dp_strategy 0 / 'no_shard' has none; use 1, 2 or 3"),
    (dict(outer_dp_sharding_strategy=1, dp_outer_dim="outer", cpu_offload=True), NotImplementedError,
     "'optim' with cpu_offload=True is not supported"),
    (dict(init_model_with_meta_device=True), ValueError, "init_model_with_meta_device=True but the module's "
                                                         "parameters are not on the meta device"),
    (dict(init_model_with_meta_device=True, zero_dp_strategy=0), ValueError,
     "with zero_dp_strategy 0 / 'no_shard' nothing is sharded"),
    (dict(fsdp_unit_modules=["torch.nn.NoSuchLayer"]), ValueError, "cannot import 'torch.nn.NoSuchLayer'"),
    (dict(fsdp_unit_modules=[int]), TypeError, "is not an nn.Module subclass"),
    (dict(sync_model_each_microbatch="yes"), TypeError, "sync_model_each_microbatch must be True or False"),
    (dict(mixed_precision_policy=object()), TypeError, "mixed_precision_policy must be a "
                                                       "megatron_fsdp.MixedPrecisionPolicy"),
])
def test_refused_arguments_name_themselves_before_any_communication(kwargs, error, message):
    # No process group exists here: each refusal comes before anything distributed is touched.
    with pytest.raises(error, match=message):
        fully_shard_model(SmallCNN(), **kwargs)


def test_mixed_precision_policy_checks_its_fields():
    with pytest.raises(ValueError, match="main_grads_dtype=torch.bfloat16 differs from main_params_dtype=torch.float32"):
        MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grad_comm_dtype must be None or a floating-point dtype"):
        MixedPrecisionPolicy(grad_comm_dtype=torch.int8)
    assert MixedPrecisionPolicy(main_grads_dtype=torch.float32).main_grads_dtype == torch.float32


def test_the_optimizer_must_hold_the_models_parameters_and_no_state():
    model = SmallCNN()
    other = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match=r"the optimizer holds parameters that are not the module's \(shapes \[\(2,\)\]\)"):
        fully_shard(model, other)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got list"):
        fully_shard(model, [])


def test_megatron_fsdp_fully_shard_is_the_function_whatever_was_imported_first():
    import megatron_fsdp.fully_shard as imported

    assert imported is fully_shard and megatron_fsdp.fully_shard is fully_shard and callable(fully_shard)


def _case_per_token_loss_sums_gradients():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = SmallCNN()
    torch.manual_seed(0)
    model = fully_shard_model(SmallCNN(), fsdp_unit_modules=[nn.Sequential], calculate_per_token_loss=True)
    x, y = batch("cnn", 0, rank)
    loss_of(model, x, y).backward()
    for r in range(world):  # the sum of every rank's gradient, not their mean
        loss_of(reference, *batch("cnn", 0, r)).backward()
    for (name, p), q in zip(model.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(gathered(p.grad), q.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_per_token_loss_sums_the_gradients_of_every_rank(pools):
    pools(2).run(_case_per_token_loss_sums_gradients)


def _case_nan_gradient_is_reported_on_every_rank():
    rank = dist.get_rank()
    model = fully_shard_model(SmallCNN(), fsdp_unit_modules=[nn.Sequential], report_nan_in_param_grad=True,
                              zero_dp_strategy=2)
    x, y = batch("cnn", 0, rank)
    if rank == 1:
        x[0, 0, 0, 0] = float("nan")
    loss_of(model, x, y).backward()
    model.finish_grad_sync()


def test_a_nan_gradient_is_reported_on_every_rank(pools):
    errors = pools(2).run_expecting_errors(_case_nan_gradient_is_reported_on_every_rank)
    assert all(e.type_name == "RuntimeError" and "NaN in the gradient of" in e.message for e in errors), errors


def _case_a_parameter_smaller_than_the_mesh():
    """The last layer's weight [1, 6] and bias [1] leave rank 1 empty shards: the NaN report and the
    gradient norms (max and 2-norm) take them as they take any other."""
    from megatron_fsdp.optimizer.clip_grads import get_grad_norm_fp32

    torch.manual_seed(0)
    model = fully_shard_model(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 1)),
                              fsdp_unit_modules=[nn.Linear], report_nan_in_param_grad=True, zero_dp_strategy=3)
    last = model.module[2]
    assert [p.to_local().numel() for p in last.parameters()] == ([6, 1] if dist.get_rank() == 0 else [0, 0])
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))).square().sum().backward()
    model.finish_grad_sync()
    grads = [p.grad for p in model.module.parameters()]
    full = torch.cat([g.full_tensor().flatten() for g in grads])
    assert get_grad_norm_fp32(grads, float("inf")) == full.abs().max().item()
    torch.testing.assert_close(get_grad_norm_fp32(grads), full.norm().item(), rtol=1e-6, atol=0)


def test_a_parameter_smaller_than_the_mesh_leaves_empty_shards_that_checks_take(pools):
    pools(2).run(_case_a_parameter_smaller_than_the_mesh)


def _case_optimizer_state_exists_and_changes_nothing(path):
    precreated = adam_run(None, 3)
    lazy = adam_run(None, 3, precreated=False)
    for a, b in zip(precreated, lazy):
        assert torch.equal(a, b)
    # Saved after 2 steps, loaded into a differently seeded model and optimizer, one more step:
    # the uninterrupted run's parameters.
    adam_run(path, 2)
    resumed = adam_run(None, 3, resume_from=path, seed=123)
    for a, b in zip(resumed, precreated):
        assert torch.equal(a, b)


@pytest.mark.slow  # a pool case with DCP
def test_optimizer_state_exists_after_sharding_and_a_dcp_round_trip_continues_exactly(pools, tmp_path):
    pools(2).run(_case_optimizer_state_exists_and_changes_nothing, str(tmp_path / "ckpt"))


def _local_bytes(tensors):
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * 4 for t in tensors if t is not None)


def _case_memory_per_strategy(strategy):
    """Bytes this rank holds between steps (fp32): parameters, gradients, Adam's two moments."""
    torch.manual_seed(0)
    module = EncoderStack()
    full = sum(p.numel() for p in module.parameters()) * 4
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=[nn.TransformerEncoderLayer], zero_dp_strategy=strategy)
    x, y = batch("encoder", 0, dist.get_rank())
    loss_of(model, x, y).backward()
    opt.step()
    params = list(model.module.parameters())
    moments = [v for s in opt.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    return full, _local_bytes(params), _local_bytes(p.grad for p in params), _local_bytes(moments)


@pytest.mark.parametrize("strategy", tiered([0, 1, 2, 3], [3]))
def test_each_strategy_holds_the_memory_its_name_promises(pools, strategy):
    world = 4
    for full, params, grads, moments in pools(world).run(_case_memory_per_strategy, strategy):
        # Shards are whole rows, padded per rank: at most a few rows above an even split.
        sharded = pytest.approx(full / world, rel=0.15)
        if strategy == 0:  # no_shard: everything replicated
            assert (params, grads, moments) == (full, full, 2 * full)
        else:  # optimizer state sharded (1), gradients too (2; FSDP2 shards them under 1 as well), params (3)
            assert moments == pytest.approx(2 * full / world, rel=0.15) and grads == sharded
            assert params == sharded  # at rest FSDP2 holds only shards, under 1 and 2 too


def _case_meta_device_init(outer):
    from torch.distributed.device_mesh import init_device_mesh

    kwargs = {}
    if outer is not None:  # HSDP ("no_shard") or HFSDP ("optim") on a 2 x 2 mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "shard"))
        kwargs = dict(device_mesh=mesh, dp_shard_dim="shard", dp_outer_dim="outer", hybrid_fsdp_group=dist.group.WORLD,
                      outer_dp_sharding_strategy=outer)
    torch.manual_seed(dist.get_rank())  # ranks draw differently: replicas must still agree
    with torch.device("meta"):
        module = EncoderStack()
    full = {name: p.numel() for name, p in module.named_parameters()}
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=[nn.TransformerEncoderLayer],
                             init_model_with_meta_device=True, device=torch.device("cpu"), **kwargs)
    shard = 4 if outer is None else 2
    for name, p in model.module.named_parameters():
        assert p.device.type == "cpu" and torch.isfinite(p.to_local()).all(), name
        assert p.to_local().numel() <= -(-p.size(0) // shard) * (full[name] // p.size(0)), name  # a shard only
    # Each module's reset_parameters ran: weights are not all zeros, LayerNorm weights are ones.
    layer = model.module.layers[0]
    assert gathered(layer.norm1.weight).eq(1).all() and gathered(layer.linear1.weight).abs().sum() > 0
    assert gathered(layer.self_attn.in_proj_weight).abs().sum() > 0  # MultiheadAttention's _reset_parameters
    x, y = batch("encoder", 0, dist.get_rank())
    loss_of(model, x, y).backward()
    opt.step()
    return [gathered(p).sum().item() for p in model.module.parameters()]


def _case_one_initialization_through_both_apis() -> None:
    """A megatron_fsdp GPT built on the meta device, materialized by TorchFullyShardedDataParallel
    and by NVIDIA's fully_shard from the same generator state: the same full weights, bit for bit
    (fully_shard once ran each layer's reset_parameters(), drawing full tensors from torch's
    generator, where the wrapper draws each rank's part from the counter-based generator)."""
    from helpers import assert_close_dicts, full_params, make_config, setup_parallel
    from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from megatron_fsdp.models.gpt import GPTModel
    from megatron_fsdp.transformer.transformer_layer import TransformerLayer

    setup_parallel(1)
    config = make_config()
    weights = {}
    for api in ("wrapper", "fully_shard"):
        torch.manual_seed(7)
        with torch.device("meta"):
            model = GPTModel(config, vocab_size=64, max_sequence_length=16, position_embedding_type="rope")
        if api == "wrapper":
            model = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
        else:
            model, _ = fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[TransformerLayer],
                                   init_model_with_meta_device=True, device=torch.device("cpu"))
        weights[api] = full_params(model.module)
    assert any(w.abs().sum() > 0 for w in weights["wrapper"].values())
    assert_close_dicts(weights["fully_shard"], weights["wrapper"], "weight", rtol=0, atol=0)

    # A layer of ours holding a parameter of its own, which no record initializes: refused by name
    # (it would keep to_empty()'s memory).
    from megatron_fsdp.tensor_parallel import ColumnParallelLinear

    class WithAScale(ColumnParallelLinear):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scale = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(WithAScale(8, 4, config=config, init_method=nn.init.zeros_))
    with pytest.raises(ValueError, match=r"init_model_with_meta_device=True cannot initialize 0\.scale: "):
        fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), init_model_with_meta_device=True,
                    device=torch.device("cpu"))


def test_a_meta_device_gpt_gets_the_same_weights_through_either_api(pools):
    pools(2).run(_case_one_initialization_through_both_apis)


@pytest.mark.parametrize("outer", tiered([None, "no_shard", "optim"], [None]), ids=["fsdp", "hsdp", "hfsdp"])
def test_meta_device_init_materializes_shards_and_replicas_agree(pools, outer):
    sums = pools(4).run(_case_meta_device_init, outer)
    assert all(s == sums[0] for s in sums)  # the same full model on every rank


def _case_cpu_offload():
    result = _case_training_matches_reference("encoder", 3, cpu_offload=True)
    return result


def test_cpu_offload_trains_like_one_process(pools):
    # On the CPU the offloaded shards stay where they are; what runs is FSDP2's offload path
    # (its copies to the compute device and back), which must not change training.
    assert pools(2).run(_case_cpu_offload) == [("optim_grads_params", 1, True)] * 2


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@requires_cuda
def test_cpu_offload_keeps_shards_gradients_and_optimizer_state_in_pinned_cpu_memory(tmp_path):
    import os

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = EncoderStack().cuda()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        model, opt = fully_shard(module, opt, fsdp_unit_modules=[nn.TransformerEncoderLayer], cpu_offload=True)
        x, y = batch("encoder", 0, 0)
        out = model(x.cuda())
        assert out.device.type == "cuda"
        nn.functional.cross_entropy(out, y.cuda()).backward()
        opt.step()
        for p in model.module.parameters():
            assert p.to_local().device.type == "cpu" and p.to_local().is_pinned()
            assert p.grad is None or p.grad.to_local().device.type == "cpu"
        assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    finally:
        dist.destroy_process_group()


def test_fully_shard_takes_nvidias_arguments_by_position_too():
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # device_mesh ... fsdp_unit_modules (10 of them), then zero_dp_strategy: checked before anything runs.
    with pytest.raises(ValueError, match="zero_dp_strategy=4: choose one of"):
        fully_shard(model, opt, None, None, None, None, None, None, None, None, None, None, 4)
    with pytest.raises(TypeError):
        fully_shard(model, opt, no_such_argument=1)


def _case_full_state_dict_loads_into_shards():
    torch.manual_seed(0)
    model = fully_shard_model(EncoderStack(), fsdp_unit_modules=[nn.TransformerEncoderLayer])
    torch.manual_seed(7)
    plain = EncoderStack()  # other weights, unsharded
    model.load_state_dict(plain.state_dict())
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
        assert torch.equal(gathered(p).detach(), q.detach()), name
    return model.module.layers[0].linear1.weight.to_local().shape[0]


def test_a_plain_models_full_state_dict_loads_into_the_shards(pools):
    assert pools(2).run(_case_full_state_dict_loads_into_shards) == [16, 16]  # 32 rows, half each
