"""The wrapper's plan: checks before any change or communication, the default
FSDP units, and the fp8 weight steps."""

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from helpers import full_tensor, make_config, setup_parallel
from megatron_fsdp.distributed import (
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
)
from megatron_fsdp import parallel_state
from megatron_fsdp.models.gpt import GPTModel
from test_fsdp import MICRO, SEQ, _build

def _case_fp8_param_gather_steps(meta, weights=None):
    """The wrapper's fp8 steps: weights converted before fully_shard (also on
    the meta device), scales computed once the values are final, TP
    attributes kept. fp8 numerics are megatron_fsdp.fp8's tests. Returns the
    first loss and the initial full weights (after loading `weights`, if given)."""
    from megatron_fsdp.fp8 import is_fp8_training_weight
    from megatron_fsdp.tensor_parallel import model_parallel_cuda_manual_seed

    setup_parallel(2)
    # fp8 GEMMs need local weight dimensions that are multiples of 16.
    cfg = make_config(hidden_size=64, ffn_hidden_size=128, fp8="e4m3", bf16=True, sequence_parallel=True)
    model_parallel_cuda_manual_seed(3)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = GPTModel(cfg, vocab_size=64, max_sequence_length=SEQ)
    wrapped = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(fp8_param_gather=True), model)
    if weights is not None:
        wrapped.load_state_dict(weights)  # the fp8 scales follow (the converter's load hook)
    layer = wrapped.module.decoder.layers[0]
    for linear, dim in ((layer.mlp.linear_fc1, 0), (layer.self_attention.linear_proj, 1)):
        assert is_fp8_training_weight(linear.weight.to_local()), type(linear.weight.to_local())
        assert (linear.weight.tensor_model_parallel, linear.weight.partition_dim) == (True, dim)
    assert not is_fp8_training_weight(wrapped.module.output_layer.weight.to_local())  # stays high precision
    initial = {k: full_tensor(v).cpu() for k, v in wrapped.module.state_dict().items() if isinstance(v, torch.Tensor)}
    ids = torch.randint(0, 64, (MICRO, SEQ), generator=torch.Generator().manual_seed(4))
    loss = wrapped(ids, torch.arange(SEQ).expand(MICRO, SEQ), None, labels=ids).float().mean()
    loss.backward()
    wrapped.finish_grad_sync()
    assert torch.isfinite(loss) and all(p.grad is not None for p in wrapped.parameters())
    return loss.item(), initial


def test_fp8_param_gather_steps_in_the_plan(pools):
    # Converted on meta, materialized, initialized, scaled: the first loss an eagerly built
    # model gives with the same weights (meta-device init draws other values than an eager build).
    meta = pools(4).run(_case_fp8_param_gather_steps, True)
    eager = pools(4).run(_case_fp8_param_gather_steps, False, meta[0][1])
    assert [loss for loss, _ in eager] == [loss for loss, _ in meta]


def test_default_units_are_megatrons():
    from megatron_fsdp.models.common.embeddings import LanguageModelEmbedding, RotaryEmbedding
    from megatron_fsdp.tensor_parallel import ColumnParallelLinear
    from megatron_fsdp.transformer import TransformerLayer

    # Named in the signature, as Megatron-Core does (no registry filled by imports).
    default = inspect.signature(TorchFullyShardedDataParallel).parameters["sub_modules_to_wrap"].default
    assert set(default) == {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding, ColumnParallelLinear}


def _case_units(model_name):
    *_, wrapped = _build(1, model_name, {}, {}, {})
    # fully_shard makes each unit an instance of an FSDP<class> subclass: name the model's class.
    return [next(c.__name__ for c in type(u).__mro__ if c.__module__.startswith("megatron_fsdp"))
            for u in wrapped.fsdp_units_in_forward_order]


def test_units_follow_megatrons_default_set(pools):
    layers = ["TransformerLayer"] * 2
    assert pools(4).run(_case_units, "plain")[0] == ["LanguageModelEmbedding", *layers, "ColumnParallelLinear"]
    # A tied embedding weight keeps the embedding in the root unit.
    assert pools(4).run(_case_units, "tied_rope")[0] == ["RotaryEmbedding", *layers, "ColumnParallelLinear"]


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all_single",
                "barrier", "broadcast", "broadcast_object_list", "gather", "recv", "reduce", "reduce_scatter_tensor",
                "scatter", "send")


@contextlib.contextmanager
def _refuse_communication():
    """Every torch.distributed collective called inside raises."""
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"torch.distributed.{name} ran before every argument was checked")
        return call

    for name in saved:
        setattr(dist, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _case_bad_input(case):
    setup_parallel(2 if case == "foreign_group_with_tp" else 1)
    group = dist.new_group(list(range(dist.get_world_size()))) if case == "foreign_group_with_tp" else None
    # bf16 parameters: the fp32 master-weight cast would show as a dtype change.
    cfg = make_config(bf16=True, params_dtype=torch.bfloat16, fp8="e4m3" if case == "fp8_reshard_int" else None)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=SEQ)
    before = [(id(p), p.dtype) for p in model.parameters()]
    try:
        with _refuse_communication():
            _wrap_bad_input(case, cfg, model, group)
    finally:
        after = [(id(p), p.dtype) for p in model.parameters()]
        assert not isinstance(model, FSDPModule) and after == before, "the model changed before the error"


def _wrap_bad_input(case, cfg, model, group):
    if case == "reshard_size":
        TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(reshard_after_forward=3), model)
    elif case == "instances":
        TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(num_distributed_optimizer_instances=2), model)
    elif case == "ddp_config_type":
        TorchFullyShardedDataParallel(cfg, {"grad_reduce_in_fp32": True}, model)
    elif case == "wrap_class":
        TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(), model, sub_modules_to_wrap={int})
    elif case == "skip_bias_unit":
        from megatron_fsdp.tensor_parallel import RowParallelLinear
        TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(), model,
                                      sub_modules_to_wrap={RowParallelLinear})
    elif case == "foreign_group_with_tp":
        TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(), model, process_group=group)
    elif case == "fp8_without_fp8_config":
        TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(fp8_param_gather=True), model)
    elif case == "fp8_reshard_int":
        ddp_config = TorchFullyShardedDataParallelConfig(fp8_param_gather=True)
        ddp_config.reshard_after_forward = 2  # set after the config's own check: the wrapper must refuse it too
        TorchFullyShardedDataParallel(cfg, ddp_config, model)
    else:
        raise AssertionError(case)


@pytest.mark.parametrize("case,error,match", [
    ("reshard_size", "ValueError", "reshard_after_forward=3 must be a divisor of the data-parallel shard size (4)"),
    ("instances", "ValueError", "num_distributed_optimizer_instances (2) differs from parallel_state's (1)"),
    ("ddp_config_type", "TypeError", "ddp_config must be a DistributedDataParallelConfig"),
    ("wrap_class", "TypeError", "sub_modules_to_wrap must hold nn.Module subclasses"),
    ("skip_bias_unit", "ValueError", "returns its bias (skip_bias_add=True)"),
    ("foreign_group_with_tp", "ValueError", "cannot be combined with tensor parallelism"),
])
def test_bad_input_raises_on_every_rank(pools, case, error, match):
    """Before any communication and before the model changes."""
    for e in pools(4).run_expecting_errors(_case_bad_input, case):
        assert e.type_name == error and match in e.message, f"rank {e.rank}: {e.type_name}: {e.message}"


@pytest.mark.parametrize("case,error,match", [
    ("fp8_without_fp8_config", "ValueError", "fp8_param_gather=True needs fp8 training"),
    ("fp8_reshard_int", "NotImplementedError", "fp8_param_gather=True with reshard_after_forward=2 is not supported"),
])
def test_fp8_param_gather_is_checked_before_communication(pools, case, error, match):
    """megatron_fsdp.fp8's checks run in the wrapper's validation: before any
    communication and before the model changes (fp8 conversion included)."""
    for e in pools(4).run_expecting_errors(_case_bad_input, case):
        assert e.type_name == error and match in e.message, f"rank {e.rank}: {e.type_name}: {e.message}"


@pytest.mark.parametrize("kwargs,match", [
    (dict(bucket_size=1000), "bucket_size=1000 is not supported"),
    (dict(keep_fp8_transpose_cache=True), "keep_fp8_transpose_cache=True is not supported"),
    (dict(data_parallel_sharding_strategy="optim_grads_params"), "use reshard_after_forward"),
    (dict(use_custom_fsdp=True), "not Megatron-FSDP"),
])
def test_ddp_config_rejects_unsupported_fields(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        TorchFullyShardedDataParallelConfig(**kwargs)
    with pytest.raises(ValueError, match="reshard_after_forward must be True, False or an int >= 2, got 1"):
        TorchFullyShardedDataParallelConfig(reshard_after_forward=1)


def test_ddp_config_accepts_fp8_param_gather_with_true_or_false_resharding():
    for reshard in (True, False):
        assert TorchFullyShardedDataParallelConfig(fp8_param_gather=True, reshard_after_forward=reshard).fp8_param_gather
    assert DistributedDataParallelConfig(fp8_param_gather=True).fp8_param_gather
    with pytest.raises(NotImplementedError,
                       match="fp8_param_gather=True with reshard_after_forward=2 is not supported"):
        TorchFullyShardedDataParallelConfig(fp8_param_gather=True, reshard_after_forward=2)
    with pytest.raises(ValueError, match="fp8_param_gather must be True or False, got 'yes'"):
        DistributedDataParallelConfig(fp8_param_gather="yes")


def _case_fp8_scales_follow_load_state_dict():
    """New weight values through the wrapper's load_state_dict get new fp8
    all-gather scales: max(e4m3) / the full weight's amax."""
    setup_parallel(2)
    cfg = make_config(hidden_size=64, ffn_hidden_size=128, fp8="e4m3", bf16=True, sequence_parallel=True)
    wrapped = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(fp8_param_gather=True),
                                            GPTModel(cfg, vocab_size=64, max_sequence_length=SEQ))
    full = {name: (p.full_tensor() * 7.0).cpu() for name, p in wrapped.module.named_parameters()}
    wrapped.load_state_dict(full)
    fc1 = wrapped.module.decoder.layers[0].mlp.linear_fc1.weight
    expected = torch.finfo(torch.float8_e4m3fn).max / full["decoder.layers.0.mlp.linear_fc1.weight"].abs().max().double()
    return float(fc1.to_local()._fp8_meta.scale), float(expected)


def test_fp8_scales_follow_load_state_dict(pools):
    for scale, expected in pools(4).run(_case_fp8_scales_follow_load_state_dict):
        assert scale == pytest.approx(expected, rel=1e-6)


def _case_cpu_offload_pairs_the_wrapper_and_the_optimizer():
    """--optimizer-cpu-offload: the wrapper keeps the shards in CPU memory (FSDP2's offload
    policy) and the optimizer must know it, and the other way round: one clear error each."""
    from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer

    setup_parallel(1)
    cfg = make_config()
    offloaded = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(cpu_offload=True),
                                              GPTModel(cfg, vocab_size=64, max_sequence_length=8))
    assert offloaded.cpu_offload
    get_megatron_optimizer(OptimizerConfig(lr=1e-3, optimizer_cpu_offload=True), offloaded)
    with pytest.raises(ValueError, match="is wrapped with CPU offload: set OptimizerConfig"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3), offloaded)
    plain = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(),
                                          GPTModel(cfg, vocab_size=64, max_sequence_length=8))
    assert not plain.cpu_offload
    with pytest.raises(ValueError, match="optimizer_cpu_offload=True but model chunk 0 .* is not wrapped with CPU"):
        get_megatron_optimizer(OptimizerConfig(lr=1e-3, optimizer_cpu_offload=True), plain)


def test_cpu_offload_pairs_the_wrapper_and_the_optimizer(pools):
    pools(2).run(_case_cpu_offload_pairs_the_wrapper_and_the_optimizer)


def test_ddp_config_checks_cpu_offload():
    assert TorchFullyShardedDataParallelConfig(cpu_offload=True).cpu_offload
    with pytest.raises(ValueError, match="cpu_offload must be True or False, got 1"):
        TorchFullyShardedDataParallelConfig(cpu_offload=1)
    with pytest.raises(ValueError, match="cpu_offload=True with fp8_param_gather=True is not supported"):
        TorchFullyShardedDataParallelConfig(cpu_offload=True, fp8_param_gather=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_offload_steps_on_the_cpu_and_computes_on_the_gpu():
    """On a GPU: the shards, gradients and Adam state stay in pinned CPU memory, the model computes
    on the GPU, and the gradient clipping's reductions (NCCL) take the CPU gradients."""
    import os

    from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        setup_parallel(1)
        cfg = make_config(bf16=True, params_dtype=torch.bfloat16)
        model = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(cpu_offload=True),
                                              GPTModel(cfg, vocab_size=64, max_sequence_length=8).cuda())
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                                           optimizer_cpu_offload=True, clip_grad=0.5), model)
        tokens = torch.randint(0, 64, (2, 8), device="cuda")
        positions = torch.arange(8, device="cuda").expand(2, -1)  # learned absolute position embeddings
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        assert loss.device.type == "cuda"
        loss.backward()
        model.finish_grad_sync()
        optimizer.step()
        for p in model.module.parameters():
            assert p.to_local().device.type == "cpu" and p.to_local().is_pinned()
        state = optimizer.optimizer.state
        assert state and all(v.device.type == "cpu" for s in state.values() for v in s.values() if torch.is_tensor(v))
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
