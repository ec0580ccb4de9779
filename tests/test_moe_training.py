"""Mixture of experts through the training stack: Megatron-LM's MoE flags (one line each for a bad
one, before any work), their configs."""

import re

import pytest

from test_usage_errors import _parse

MOE = ["--use-torch-fsdp2", "--disable-bias-linear", "--swiglu", "--num-experts", "4"]


@pytest.mark.parametrize("flags, message", [
    (["--use-torch-fsdp2", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size and --expert-tensor-parallel-size need --num-experts"),
    (["--disable-bias-linear", "--num-experts", "4"], "--num-experts needs --use-torch-fsdp2"),
    ([*MOE, "--expert-model-parallel-size", "3"],
     "world size 4 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 3"),
    ([*MOE, "--expert-model-parallel-size", "0"], "--expert-model-parallel-size must be a positive integer, got 0"),
    (["--use-torch-fsdp2", "--disable-bias-linear", "--num-experts", "6", "--expert-model-parallel-size", "4"],
     "--num-experts (6) must be divisible by --expert-model-parallel-size (4)"),
    (["--use-torch-fsdp2", "--num-experts", "4"], "--num-experts needs --disable-bias-linear"),
    ([*MOE, "--moe-router-topk", "1"], "--moe-router-topk=1 with softmax scores needs --moe-router-pre-softmax=True"),
    ([*MOE, "--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-router-load-balancing-type='sinkhorn' is not supported (one of 'aux_loss', 'seq_aux_loss', 'none')"),
    ([*MOE, "--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type='flex' is not supported"),
    ([*MOE, "--moe-layer-freq", "[1]*3"], "--moe-layer-freq as a pattern needs one 0 (dense) or 1 (MoE) per layer (2)"),
    ([*MOE, "--moe-layer-freq", "__import__('os')"], "is not an int or a list pattern"),
    ([*MOE, "--tensor-model-parallel-size", "2"],
     "mixture-of-experts layers with --tensor-model-parallel-size > 1 need --sequence-parallel=True"),
    ([*MOE, "--moe-router-group-topk", "2"], "group-limited routing is not supported"),
    ([*MOE, "--moe-shared-expert-gate"], "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
    ([*MOE, "--moe-router-enable-expert-bias"],
     "--moe-router-enable-expert-bias (aux-loss-free balancing) needs --moe-router-score-function='sigmoid'"),
])
def test_bad_moe_flags_are_one_line_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(*flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err


def test_moe_flags_make_the_config_megatron_lm_makes():
    args = _parse(*MOE, "--moe-layer-freq", "([1]*1+[0]*1)*1", "--moe-router-topk", "2",
                  "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-token-dispatcher-type",
                  "alltoall", "--expert-model-parallel-size", "2", "--moe-shared-expert-intermediate-size", "64",
                  "--moe-shared-expert-gate", "--moe-router-dtype", "fp32", "--moe-grouped-gemm")
    config = args.configs.model
    assert (config.num_moe_experts, config.moe_layer_freq, config.moe_router_topk) == (4, [1, 0], 2)
    assert (config.moe_aux_loss_coeff, config.moe_z_loss_coeff) == (0.01, 0.001)
    assert (config.moe_token_dispatcher_type, config.expert_model_parallel_size) == ("alltoall", 2)
    assert (config.moe_shared_expert_intermediate_size, config.moe_shared_expert_gate) == (64, True)
    assert (config.moe_router_dtype, config.moe_grouped_gemm) == ("fp32", True)
    assert config.moe_ffn_hidden_size == config.ffn_hidden_size  # Megatron's default
    assert config.expert_tensor_parallel_size is None  # the dense TP size (1)


# ---------------------------------------------------------------- pretrain() with experts

# test_training's GPT (2 layers, SwiGLU, GQA, RoPE) with 4 experts of top-2 in every layer, the
# auxiliary and z losses on; the vocabulary padded alike at TP 1 and 2.
EXPERTS = ["--disable-bias-linear", "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
           "--moe-z-loss-coeff", "1e-3", "--make-vocab-size-divisible-by", "32", "--train-iters", "4",
           "--eval-iters", "0"]
ITERATION = re.compile(r"iteration\s+(\d+)/")
# NOTE: the gradient norm too: Adam hides a gradient off by a constant factor from the losses (an
# expert gradient 4x too large moved the losses by 2e-6 only), not from the norm.
LOSSES = ("lm loss", "load_balancing_loss", "z_loss", "grad norm")


def _losses(job) -> dict[int, tuple[float, ...]]:
    """{iteration: (lm loss, load_balancing_loss, z_loss, grad norm)} of the log lines."""
    found = {}
    for line in job.stdout.splitlines():
        values = [re.search(rf"\| {name}: ([\d.E+-]+) \|", line) for name in LOSSES]
        if ITERATION.search(line) and all(values):
            found[int(ITERATION.search(line)[1])] = tuple(float(v[1]) for v in values)
    return found


@pytest.fixture(scope="module")
def one_process(pools):
    from test_training import _pretrain

    return _losses(_pretrain(pools, 1, *EXPERTS))


def _layouts():
    """(world, layout line, flags), each with both dispatchers; the suite runs alltoall at EP 2, at
    TP 2 + SP x EP 2 and at EP 4, the compositions step the rest."""
    layouts = [
        (2, "expert-parallel 2", ["--expert-model-parallel-size", "2"], True),  # EP 2 (DP 2)
        (4, "expert-parallel 2", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--expert-model-parallel-size", "2"], True),  # TP 2 + SP x EP 2 (expert TP 2)
        (4, "expert-parallel 2", ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"], False),
        (4, "expert-parallel 2", ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"], False),
        (4, "expert-parallel 4", ["--expert-model-parallel-size", "4"], True),  # one expert per rank, DP 4
    ]
    for i, (world, layout, flags, in_suite) in enumerate(layouts):
        for dispatcher in ("alltoall", "allgather"):
            marks = [] if in_suite and dispatcher == "alltoall" else [pytest.mark.compositions]
            yield pytest.param(dispatcher, world, layout, flags, marks=marks, id=f"layout{i}-{dispatcher}")


@pytest.mark.slow  # pretrain() jobs in the worker pool
@pytest.mark.parametrize("dispatcher,world,layout,flags", list(_layouts()))
def test_pretrain_with_experts_repeats_one_process(pools, one_process, dispatcher, world, layout, flags):
    """The same losses (the language model's and the routers' auxiliary ones), step for step, as
    the one-process run: experts split over EP ranks, FSDP over the expert-data-parallel ranks."""
    from test_training import _pretrain

    job = _pretrain(pools, world, *EXPERTS, *flags, "--moe-token-dispatcher-type", dispatcher)
    assert layout in job.stdout, job.stdout[-2000:]
    got = _losses(job)
    assert sorted(one_process) == [1, 2, 3, 4] and got.keys() == one_process.keys(), (got, one_process)
    for iteration, expected in one_process.items():
        assert got[iteration][:3] == pytest.approx(expected[:3], rel=1e-5), (iteration, got, one_process)
        assert got[iteration][3] == pytest.approx(expected[3], abs=2e-3), (iteration, got, one_process)  # 3 decimals


@pytest.mark.slow  # pretrain() jobs in the worker pool
def test_checkpoints_are_expert_parallel_invariant(pools, tmp_path):
    """Saved at EP 2 (x DP 2, 4 ranks), resumed at EP 1 (2 ranks), at EP 4, and at TP 2 + SP with
    expert TP 2 x EP 2: each continues with the losses of the run it saved (the same full expert
    weights and optimizer state at any expert layout)."""
    from test_training import _pretrain

    def tracker_to(iteration):
        with open(tmp_path / "ep2" / "latest_checkpointed_iteration.txt", "w") as f:
            f.write(f"{iteration}\n")

    run = [*EXPERTS, "--moe-token-dispatcher-type", "alltoall"]
    saved = _losses(_pretrain(pools, 4, *run, "--expert-model-parallel-size", "2", "--save", str(tmp_path / "ep2"),
                              "--save-interval", "2"))
    tracker_to(2)
    load = ["--load", str(tmp_path / "ep2")]
    resumed = {
        "ep2 -> ep1": _losses(_pretrain(pools, 2, *run, *load)),
        "ep2 -> ep4": _losses(_pretrain(pools, 4, *run, "--expert-model-parallel-size", "4", *load)),
        "ep2 -> tp2 x etp2 x ep2": _losses(_pretrain(pools, 4, *run, "--tensor-model-parallel-size", "2",
                                                     "--sequence-parallel", "--expert-model-parallel-size", "2",
                                                     *load)),
    }
    for how, got in resumed.items():
        assert sorted(got) == [3, 4], (how, got)
        for iteration in (3, 4):
            assert got[iteration][:3] == pytest.approx(saved[iteration][:3], rel=1e-5), (how, got, saved)
            assert got[iteration][3] == pytest.approx(saved[iteration][3], abs=2e-3), (how, got, saved)


# ---------------------------------------------------------------- the NVIDIA fully_shard API

def _case_nvidia_fully_shard_with_experts(ep: int):
    import torch
    import torch.nn.functional as F

    from helpers import batch, make_config, setup_parallel
    from megatron_fsdp import parallel_state
    from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from megatron_fsdp.fully_shard import fully_shard_model
    from megatron_fsdp.models.gpt import GPTModel
    from megatron_fsdp.transformer import TransformerLayer

    setup_parallel(1, expert_model_parallel_size=ep)
    cfg = make_config(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, gated_linear_unit=True,
                      activation_func=F.silu, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep)

    def build():
        torch.manual_seed(3)
        return GPTModel(cfg, vocab_size=64, max_sequence_length=16)

    ours = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(), build())
    # NVIDIA Megatron-FSDP's way: the expert mesh beside the dense one (parallel_state's, "expt_dp").
    nvidia = fully_shard_model(build(), device_mesh=parallel_state.get_device_mesh(), dp_shard_dim="dp_shard_cp",
                               tp_dim="tp", expt_device_mesh=parallel_state.get_expert_device_mesh(),
                               fsdp_unit_modules=[TransformerLayer])
    experts = nvidia.module.decoder.layers[0].mlp.experts
    assert experts.linear_fc1.weight.device_mesh.mesh_dim_names == ("expt_dp", "ep", "etp")
    ids, labels, positions, weights = batch(64, seed=dist_rank())
    grads = []
    for model in (ours, nvidia):
        loss = model(ids, positions, None, labels=labels)
        (loss * weights).sum().backward()
        model.finish_grad_sync()
        grads.append({n.removeprefix("module."): p.grad.full_tensor() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@pytest.mark.parametrize("ep", [2, 4])
def test_nvidias_fully_shard_shards_experts_over_expt_device_mesh(pools, ep):
    """fully_shard_model(..., expt_device_mesh=...) gives every gradient TorchFullyShardedDataParallel
    gives (the experts sharded over the expert-data-parallel ranks, divided by the dense DP size)."""
    pools(4).run(_case_nvidia_fully_shard_with_experts, ep)


def _case_meta_init_with_experts():
    import torch.nn.functional as F

    from helpers import assert_close_dicts, full_params, make_config, setup_parallel
    from megatron_fsdp import parallel_state
    from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from megatron_fsdp.initialization import initialize_parameters
    from megatron_fsdp.models.gpt import GPTModel

    def config(**parallel):
        return make_config(num_moe_experts=4, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                           moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, **parallel)

    import torch

    setup_parallel(2, expert_model_parallel_size=2)
    cfg = config(sequence_parallel=True, expert_model_parallel_size=2)
    with torch.device("meta"):
        model = GPTModel(cfg, vocab_size=64, max_sequence_length=16)
    wrapped = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(), model)
    sharded = full_params(wrapped.module)
    parallel_state.destroy_model_parallel()
    setup_parallel(1)
    with torch.device("meta"):
        whole = GPTModel(config(), vocab_size=64, max_sequence_length=16)
    whole.to_empty(device="cpu")
    initialize_parameters(whole)
    assert_close_dicts(sharded, full_params(whole), "meta-initialized weight", rtol=0, atol=0)
    biases = [m.expert_bias for m in wrapped.module.modules() if getattr(m, "expert_bias", None) is not None]
    assert biases and all(torch.equal(b, torch.zeros_like(b)) for b in biases)  # reset_buffers ran


def test_meta_init_gives_the_same_weights_at_any_expert_layout(pools):
    """A meta-device MoE model wrapped at TP 2 + SP x EP 2 (expert TP 2) gets, rank by rank, its part
    of the weights one whole model initialized in one process gets; the expert biases start at zero."""
    pools(4).run(_case_meta_init_with_experts)


@pytest.mark.compositions
@pytest.mark.slow  # pretrain() jobs in the worker pool
def test_pretrain_with_every_router_option_repeats_one_process(pools):
    """Sigmoid scores with the expert bias updated each step (aux-loss-free), a top-k scaling factor,
    Qwen2's gated shared expert, the grouped-GEMM path, capacity with token dropping: EP 2 x DP 2
    with full activation recomputation equals one process step for step."""
    from test_training import _pretrain

    flags = [*EXPERTS, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", "1e-2", "--moe-router-topk-scaling-factor", "2.5",
             "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate", "--moe-grouped-gemm",
             "--moe-expert-capacity-factor", "1.5", "--moe-token-dispatcher-type", "alltoall"]
    expected = _losses(_pretrain(pools, 1, *flags))
    # (the EP run recomputes its layers in the backward too: the routers count and log once)
    got = _losses(_pretrain(pools, 4, *flags, "--expert-model-parallel-size", "2", "--recompute-granularity", "full",
                            "--recompute-method", "uniform", "--recompute-num-layers", "1"))
    assert sorted(expected) == [1, 2, 3, 4] and got.keys() == expected.keys(), (got, expected)
    for iteration in expected:
        assert got[iteration][:3] == pytest.approx(expected[iteration][:3], rel=1e-5), (iteration, got, expected)
        assert got[iteration][3] == pytest.approx(expected[iteration][3], abs=2e-3), (iteration, got, expected)


@pytest.mark.e2e
@pytest.mark.compositions  # the README's command: CI's compositions step
def test_the_readmes_mixture_of_experts_command_runs_as_written():
    """README's "Mixture of experts" command, as written: 4 processes, EP 2."""
    from helpers import run_readme_command

    proc = run_readme_command("Mixture of experts")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 experts: expert-parallel 2 x expert-tensor-parallel 1 x expert-data-parallel 2" in proc.stdout
    assert re.search(r"iteration\s+10/\s+10 \|.*lm loss: [\d.E+]+ \|.*load_balancing_loss: [\d.E+]+ \|",
                     proc.stdout), proc.stdout[-2000:]


@pytest.mark.compositions
@pytest.mark.slow  # compiles on 2 cores
def test_moe_layers_compile_and_train_like_eager_ones(pools):
    """--torch-compile at EP 2 (the router, the all-to-all dispatch with its host-side split sizes and
    the experts inside each compiled TransformerLayer), traced under aot_eager as
    tests/test_torch_compile.py does: the losses equal eager's bit for bit; the compiled layers ran."""
    from test_torch_compile import train_eager_and_compiled
    from test_training import MODEL, RUN

    runs = train_eager_and_compiled(pools, 2, [*MODEL, *RUN, *EXPERTS, "--train-iters", "3",
                                               "--expert-model-parallel-size", "2",
                                               "--moe-token-dispatcher-type", "alltoall"])
    losses = {compiled: losses for compiled, (losses, _) in runs.items()}
    assert len(losses[False]) == 3 and losses[True] == losses[False], losses


def _case_experts_elsewhere_need_their_own_units(how: str):
    import torch.nn.functional as F

    from helpers import make_config, setup_parallel
    from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from megatron_fsdp.fully_shard import fully_shard_model
    from megatron_fsdp import parallel_state
    from megatron_fsdp.models.gpt import GPTModel
    from megatron_fsdp.transformer import TransformerLayer

    setup_parallel(1, expert_model_parallel_size=2)
    cfg = make_config(num_moe_experts=4, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                      expert_model_parallel_size=2)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=16)
    if how == "disable_bucketing":
        TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(), model, disable_bucketing=True)
    else:
        fully_shard_model(model, device_mesh=parallel_state.get_device_mesh(), dp_shard_dim="dp_shard_cp",
                          tp_dim="tp", fsdp_unit_modules=[TransformerLayer])


@pytest.mark.parametrize("how, message", [
    ("disable_bucketing", "disable_bucketing=True with expert parallelism"),
    ("nvidia_without_expt_device_mesh", "pass expt_device_mesh (parallel_state.get_expert_device_mesh())"),
])
def test_experts_on_other_ranks_are_never_sharded_with_the_dense_layers(pools, how, message):
    """At EP 2 the experts' gradients must be reduced over their own ranks: a wrapping that would
    shard them with the dense layers is refused in one line, on every rank, before any work."""
    errors = pools(2).run_expecting_errors(_case_experts_elsewhere_need_their_own_units, how)
    assert len(errors) == 2 and all(message in e.message for e in errors), errors[0].message


def _case_a_finished_moe_job_leaves_nothing_alive(dispatcher: str) -> list:
    """One training step of an FSDP-wrapped MoE model in a job of its own default group; then
    whether any module outlives it. (The allgather dispatcher kept its routing weights, a tensor
    with autograd history, on the module: the graph's FSDP hooks then kept the model, its groups
    and their threads alive after the job, 25 threads a job.)"""
    import datetime
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from helpers import make_config
    from megatron_fsdp import parallel_state, tensor_parallel
    from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from megatron_fsdp.models.gpt import GPTModel
    from megatron_fsdp.training.initialize import shutdown_distributed
    from pretrain_in_pool import own_process_group_job

    with own_process_group_job():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        cfg = make_config(num_moe_experts=4, add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
                          expert_model_parallel_size=2, sequence_parallel=True, tensor_model_parallel_size=2,
                          moe_token_dispatcher_type=dispatcher)
        model = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(),
                                              GPTModel(cfg, vocab_size=64, max_sequence_length=16))
        ids = torch.randint(0, 64, (2, 16))
        model(ids, torch.arange(16).expand(2, 16), None, labels=ids).sum().backward()
        model.finish_grad_sync()
        del model
        shutdown_distributed()
    gc.collect()
    return [type(o).__name__ for o in gc.get_objects() if isinstance(o, torch.nn.Module)]


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_a_finished_moe_job_leaves_no_module_alive(pools, dispatcher):
    assert pools(4).run(_case_a_finished_moe_job_leaves_nothing_alive, dispatcher) == [[]] * 4
