"""The training pieces at Megatron-Core's paths: get_forward_backward_func,
finalize_model_grads, get_model_config, MegatronModule, and the log line's
TFLOP/s (megatron_fsdp.training.training_log)."""

import argparse
import contextlib
import importlib.util
import re

import pytest
import torch

from helpers import full_grads, setup_parallel

from megatron_fsdp.model_parallel_config import ModelParallelConfig
from megatron_fsdp.pipeline_parallel import get_forward_backward_func
from megatron_fsdp.transformer.module import MegatronModule
from megatron_fsdp.utils import get_model_config


class _Wrapper(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_get_model_config_looks_through_wrappers():
    inner = MegatronModule(ModelParallelConfig())
    assert get_model_config(_Wrapper(_Wrapper(inner))) is inner.config
    with pytest.raises(RuntimeError, match="no attribute 'config'"):
        get_model_config(_Wrapper(torch.nn.Linear(2, 2)))


def test_schedule_runs_all_but_the_last_microbatch_in_no_sync_then_finalizes():
    events = []

    class Model(MegatronModule):
        def __init__(self):
            super().__init__(ModelParallelConfig())
            self.weight = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return (self.weight * x).sum()

    model = Model()

    @contextlib.contextmanager
    def no_sync():
        events.append("no_sync enter")
        yield
        events.append("no_sync exit")

    model.config.no_sync_func = no_sync
    model.config.finalize_model_grads_func = lambda chunks, num_tokens, **kw: events.append(("finalize", num_tokens))
    model.config.grad_scale_func = lambda loss: loss * 8.0
    data = iter([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 0.0, 0.0]), torch.tensor([0.0, 0.0, 4.0])])

    def forward_step(data_iterator, m):
        x = next(data_iterator)
        events.append("forward")

        def loss_func(output):
            return output, torch.tensor(2), {"lm loss": torch.stack([output.detach(), torch.tensor(2.0)])}
        return m(x), loss_func

    reports = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=[model],
                                          num_microbatches=3, seq_length=1, micro_batch_size=1)
    assert events == ["no_sync enter", "forward", "forward", "no_sync exit", "forward", ("finalize", None)]
    assert [r["lm loss"].tolist() for r in reports] == [[6.0, 2.0], [2.0, 2.0], [4.0, 2.0]]
    # Megatron's scaling: each loss / its 2 tokens / 3 microbatches, times grad_scale_func's 8.
    torch.testing.assert_close(model.weight.grad, torch.tensor([3.0, 2.0, 7.0]) * 8.0 / 6.0)


@pytest.mark.parametrize("kwargs, config_fields, match", [
    ({"pg_collection": object()}, {}, "pg_collection=object is not supported"),
    ({"force_all_reduce": True}, {}, "force_all_reduce=True is not supported"),
    ({}, {"calculate_per_token_loss": True}, "config.calculate_per_token_loss=True is not supported"),
])
def test_schedule_refuses_what_it_cannot_honour_before_any_microbatch(kwargs, config_fields, match):
    model = MegatronModule(ModelParallelConfig())
    for name, value in config_fields.items():
        setattr(model.config, name, value)
    ran = []
    with pytest.raises(NotImplementedError, match=match):
        get_forward_backward_func()(forward_step_func=lambda it, m: ran.append("forward"), data_iterator=iter([]),
                                    model=[model], num_microbatches=2, **kwargs)
    assert ran == []


def test_schedule_rejects_pipeline_parallelism():
    with pytest.raises(NotImplementedError, match="pp_size=2"):
        get_forward_backward_func(pp_size=2)


# ---------------------------------------------------------------------- multi-process


def _gpt():
    from megatron_fsdp import parallel_state, tensor_parallel
    from megatron_fsdp.models.gpt import GPTModel
    from megatron_fsdp.transformer import TransformerConfig

    torch.manual_seed(7)  # every call builds the same weights
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=True,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size())
    return GPTModel(config, vocab_size=64, max_sequence_length=16)


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    positions = torch.arange(tokens.size(1)).expand_as(tokens)
    mask = torch.ones_like(tokens, dtype=torch.float)
    losses = model(tokens, positions, None, labels=labels)

    def loss_func(output):
        loss = (output.float().view(-1) * mask.view(-1)).sum()
        tokens_here = mask.sum().to(torch.int)
        return loss, tokens_here, {"lm loss": torch.stack([loss.detach(), tokens_here.float()])}
    return losses, loss_func


def _run_step(model, micro_batches):
    from megatron_fsdp.distributed.finalize_model_grads import finalize_model_grads

    config = get_model_config(model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = getattr(model, "no_sync", None)
    reports = get_forward_backward_func()(forward_step_func=_forward_step, data_iterator=iter(micro_batches),
                                          model=[model], num_microbatches=len(micro_batches), seq_length=16,
                                          micro_batch_size=micro_batches[0][0].size(0))
    return reports


def _case_microbatches_equal_one_big_batch():
    from megatron_fsdp import parallel_state
    from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig

    setup_parallel(tp=2)
    dp_rank = parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(100 + dp_rank)  # each data-parallel rank its own 4 sequences
    tokens, labels = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)

    # The independent reference: one big batch, the mean loss per token, plain backward.
    reference = _gpt()
    positions = torch.arange(16).expand(4, 16)
    reference(tokens, positions, None, labels=labels).mean().backward()
    for p in reference.parameters():  # data-parallel mean, as every wrapper computes it
        g_local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        torch.distributed.all_reduce(g_local, group=parallel_state.get_data_parallel_group())
        g_local.div_(parallel_state.get_data_parallel_world_size())
    expected = full_grads(reference)

    micro = [(tokens[i:i + 1], labels[i:i + 1]) for i in range(4)]
    for wrap in ("bare", "fsdp"):
        model = _gpt()
        if wrap == "fsdp":
            model = TorchFullyShardedDataParallel(model.config, TorchFullyShardedDataParallelConfig(), model)
        reports = _run_step(model, micro)
        assert len(reports) == 4
        got = full_grads(model.module if wrap == "fsdp" else model)
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{wrap} {name}: {m}")


def test_forward_backward_microbatching_equals_one_big_batch(pools):
    pools(4).run(_case_microbatches_equal_one_big_batch)


def _case_finalize_scales_by_global_tokens():
    from megatron_fsdp import parallel_state
    from megatron_fsdp.distributed.finalize_model_grads import finalize_model_grads

    setup_parallel(tp=1)
    rank = parallel_state.get_data_parallel_rank()
    model = _gpt()
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    finalize_model_grads([model], num_tokens=torch.tensor(rank + 2, dtype=torch.int))
    # Gradients summed over the 2 ranks (1 + 2), divided by all tokens (2 + 3).
    for p in model.parameters():
        torch.testing.assert_close(p.grad, torch.full_like(p, 3.0 / 5.0))


def test_finalize_model_grads_divides_by_the_global_token_count(pools):
    pools(2).run(_case_finalize_scales_by_global_tokens)


# ---------------------------------------------------------------------- the log line


def _flops(B, s, L, h, f, heads, groups, kv_channels, V, swiglu):
    """Megatron-LM's dense-GPT FLOPs, written out term by term."""
    q, kv = kv_channels * heads, kv_channels * groups
    mlp = (3 if swiglu else 2) * 2 * h * f       # fc1 (2 outputs with SwiGLU) and fc2, 2 flops per MAC
    qkv = 2 * h * (q + 2 * kv)
    proj = 2 * q * h
    core = 2 * 2 * s * q / 2                     # QK^T and AV per token, causal half
    logits = 2 * h * V
    forward = B * s * (L * (mlp + qkv + proj + core) + logits)
    return 3 * forward                           # forward + two backward GEMMs


def test_log_line_tflops_equals_megatrons_formula(capsys):
    from megatron_fsdp.training import training_log

    args = argparse.Namespace(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        group_query_attention=True, num_query_groups=8, kv_channels=128, swiglu=True, seq_length=8192,
        padded_vocab_size=128256, world_size=64, train_iters=1000, log_interval=2, log_throughput=True,
        tensorboard_log_interval=1, log_timers_to_tensorboard=False, consumed_train_samples=0,
        log_loss_scale_to_tensorboard=True, log_world_size_to_tensorboard=False, log_memory_to_tensorboard=False)
    clock = iter([100.0, 131.5, 131.5])  # the window starts at 100 s; 2 iterations take 31.5 s
    logger = training_log.TrainingLogger(args, clock=lambda: next(clock))
    for iteration, loss in ((1, 2.5), (2, 1.5)):
        args.consumed_train_samples += 512
        logger.training_log({"lm loss": loss}, 3e-4, iteration, 1.0, 0, 0.75, None, None, 512)
    line = capsys.readouterr().out.rstrip("\n")
    expected = _flops(512, 8192, 32, 4096, 14336, 32, 8, 128, 128256, True) / (15.75 * 1e12 * 64)
    tflops = float(re.search(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \|", line)[1])
    assert tflops == pytest.approx(expected, abs=0.05), line
    assert 100 < tflops < 1000
    assert f"throughput per GPU (tokens/s/GPU): {512 * 8192 / (15.75 * 64):.1f} |" in line
    assert re.match(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\] iteration        2/    1000 \| "
                    r"consumed samples:         1024 \| elapsed time per iteration \(ms\): 15750\.0 \|", line), line
    assert line.endswith("| learning rate: 3.000000E-04 | global batch size:   512 | lm loss: 2.000000E+00 | "
                         "loss scale: 1.0 | grad norm: 0.750 | number of skipped iterations:   0 | "
                         "number of nan iterations:   0 |"), line


def test_small_throughputs_keep_three_significant_digits():
    from megatron_fsdp.training.training_log import format_throughput
    assert format_throughput(123.456) == "123.5"
    assert format_throughput(0.000226449) == "0.000226"
    assert format_throughput(0.0123) == "0.0123"
    assert format_throughput(0.0) == "0.0"


# ---------------------------------------------------------------------- flags


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64"]


def _parse(*flags, world_size="1"):
    import os
    from unittest import mock

    from megatron_fsdp.training.arguments import parse_args
    with mock.patch.dict(os.environ, {"WORLD_SIZE": world_size, "RANK": "0"}):
        return parse_args([*BASE, *flags])


@pytest.mark.parametrize("flags, message", [
    (["--train-iters", "4", "--rampup-batch-size", "2", "2", "100"], "--rampup-batch-size needs --train-samples"),
    (["--train-iters", "4", "--train-samples", "8"], "exactly one of --train-iters and --train-samples"),
    (["--train-samples", "64", "--lr-warmup-iters", "2"], "--lr-warmup-iters needs --train-iters"),
    (["--train-iters", "4", "--fp8-recipe", "tensorwise"], "--fp8-recipe need --fp8-format"),
    (["--train-iters", "4", "--data-path", "x"], "exactly one data source"),
    (["--train-iters", "4", "--log-timers-to-tensorboard"], "needs --tensorboard-dir or --wandb-project"),
    (["--train-iters", "4", "--fp8-format", "e4m3", "--fp8-amax-history-len", "0"],
     "--fp8-amax-history-len must be an integer >= 1, got 0"),
])
def test_bad_flag_combinations_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(*flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_negative_fp8_margin_reaches_the_config_as_the_api_allows():
    from megatron_fsdp.training.arguments import core_transformer_config_from_args

    args = _parse("--train-iters", "4", "--fp8-format", "e4m3", "--fp8-margin", "-1")
    assert core_transformer_config_from_args(args, config_class=dict)["fp8_margin"] == -1


def test_megatron_defaults_are_derived():
    args = _parse("--train-iters", "4", "--swiglu", world_size="4")
    assert args.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64 == 128  # Megatron's SwiGLU default
    assert args.kv_channels == 16 and args.num_query_groups == 4
    assert args.global_batch_size == 2 * 4 and args.data_parallel_size == 4
    assert args.eval_iters == 100 and args.eval_interval is None and args.log_interval == 100


def test_fp8_fields_reach_the_config_only_with_fp8():
    from megatron_fsdp.training.arguments import core_transformer_config_from_args

    plain = core_transformer_config_from_args(_parse("--train-iters", "4"), config_class=dict)
    assert not any(name.startswith(("fp8", "first_last", "num_layers_at")) for name in plain)
    fp8 = core_transformer_config_from_args(
        _parse("--train-iters", "4", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--no-fp8-wgrad",
               "--fp8-amax-history-len", "4", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2"),
        config_class=dict)
    assert {k: v for k, v in fp8.items() if k.startswith(("fp8", "first_last", "num_layers_at"))} == dict(
        fp8="hybrid", fp8_recipe="tensorwise", fp8_margin=0, fp8_amax_history_len=4,
        fp8_amax_compute_algo="most_recent", fp8_wgrad=False, first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=2, fp8_param=False)
    gather = core_transformer_config_from_args(
        _parse("--train-iters", "4", "--use-torch-fsdp2", "--fp8-format", "e4m3", "--fp8-param-gather"),
        config_class=dict)
    assert gather["fp8_param"] is True  # Megatron-LM: fp8_param follows --fp8-param-gather


@pytest.mark.parametrize("flags, expected", [
    # Megatron-LM's defaults: every fusion on, RoPE fusion only with RoPE.
    # Megatron-LM's one fusion off by default: the cross entropy's.
    ((), dict(bias_activation_fusion=True, masked_softmax_fusion=True, bias_dropout_fusion=True,
              apply_rope_fusion=False, persist_layer_norm=True, cross_entropy_loss_fusion=False,
              cross_entropy_fusion_impl="native")),
    (("--cross-entropy-loss-fusion",), dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")),
    (("--cross-entropy-fusion-impl", "te"), dict(cross_entropy_loss_fusion=False, cross_entropy_fusion_impl="te")),
    (("--position-embedding-type", "rope"), dict(apply_rope_fusion=True)),
    (("--position-embedding-type", "rope", "--no-rope-fusion"), dict(apply_rope_fusion=False)),
    (("--no-bias-gelu-fusion",), dict(bias_activation_fusion=False)),
    (("--disable-bias-linear",), dict(bias_activation_fusion=False)),  # no bias: no bias+GELU fusion
    (("--swiglu", "--disable-bias-linear"), dict(bias_activation_fusion=True)),
    (("--swiglu", "--no-bias-swiglu-fusion"), dict(bias_activation_fusion=False)),
    (("--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm"),
     dict(masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False)),
])
def test_fusion_flags_follow_megatron_lm(flags, expected):
    from megatron_fsdp.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(_parse("--train-iters", "4", *flags), config_class=dict)
    assert {k: config[k] for k in expected} == expected


@pytest.mark.parametrize("flag, package", [("--tensorboard-dir", "tensorboard"), ("--wandb-project", "wandb")])
def test_a_logging_flag_without_its_package_is_a_clear_error(flag, package, capsys):
    from unittest import mock

    real = importlib.util.find_spec
    with mock.patch("importlib.util.find_spec", lambda name, *a: None if name == package else real(name, *a)):
        with pytest.raises(SystemExit):
            _parse("--train-iters", "4", flag, "x")
    assert f"{flag} needs the {package} package" in capsys.readouterr().err


@pytest.mark.parametrize("flags, decay_steps, warmup_steps", [
    (["--train-iters", "10", "--lr-warmup-iters", "2"], 10 * 8, 2 * 8),   # iterations count as global batches
    (["--train-samples", "72", "--lr-warmup-samples", "6"], 72, 6),
    (["--train-samples", "72", "--lr-decay-samples", "50", "--lr-warmup-fraction", "0.1"], 50, 5.0),
])
def test_learning_rate_schedule_counts_samples_like_megatron(flags, decay_steps, warmup_steps):
    from megatron_fsdp.training.training import get_optimizer_param_scheduler

    args = _parse("--global-batch-size", "8", *flags)
    if args.train_samples:
        args.train_iters = 9  # what pretrain derives from --train-samples before building the schedule
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = get_optimizer_param_scheduler(optimizer, args)
    assert (scheduler.lr_decay_steps, scheduler.lr_warmup_steps) == (decay_steps, warmup_steps)


@pytest.mark.parametrize("samples, global_batch, iterations", [(100, 16, 6), (96, 16, 6), (15, 16, 0)])
def test_train_samples_count_whole_global_batches_as_megatron(samples, global_batch, iterations):
    """Megatron-LM 0.19's update_train_iters: train_samples // global_batch_size; a partial last
    batch would run past a dataset built for exactly train_samples samples."""
    from types import SimpleNamespace

    from megatron_fsdp.training.training import _iterations_for_samples

    args = SimpleNamespace(train_samples=samples, global_batch_size=global_batch)
    assert _iterations_for_samples(args) == iterations


def _case_exit_duration(minutes):
    import time
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_fsdp.training.evaluation import exit_duration_reached

    setup_parallel(1)
    args = SimpleNamespace(exit_duration_in_mins=minutes)
    # Only rank 0 has been running long: every rank must decide to stop at the same iteration.
    start = time.time() - (3600 if dist.get_rank() == 0 else 0)
    return exit_duration_reached(args, start), exit_duration_reached(args, None)


def test_exit_duration_is_one_decision_for_every_rank(pools):
    assert pools(2).run(_case_exit_duration, 1.0) == [(True, False)] * 2
    assert pools(2).run(_case_exit_duration, 120.0) == [(False, False)] * 2
    assert pools(2).run(_case_exit_duration, None) == [(False, False)] * 2
