"""Mistakes in the flags or the launch that are usage errors: one line on rank 0, exit code 2,
before any work or communication (training/arguments.py, training/initialize.py)."""

import os
import sys
from argparse import Namespace
from unittest import mock

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--train-iters", "4"]


def _parse(*flags, world_size=4, rank=0):
    from megatron_fsdp.training.arguments import parse_args
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world_size), "RANK": str(rank)}):
        return parse_args([*BASE, *flags])


@pytest.mark.parametrize("flags, message", [
    (["--num-attention-heads", "6", "--hidden-size", "60", "--tensor-model-parallel-size", "4"],
     "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads (4) must be divisible by --num-query-groups (3)"),
    (["--group-query-attention", "--num-query-groups", "2", "--num-attention-heads", "8",
      "--tensor-model-parallel-size", "4"], "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (4)"),
    (["--hidden-size", "30"],
     "--hidden-size (30) must be divisible by --num-attention-heads (4) unless --kv-channels is given"),
    # The rules of values are their dataclasses' (training/configs.py builds them), in the flags' words.
    (["--fp16", "--bf16"], "--fp16 and --bf16 cannot both be True"),
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--num-layers", "0"], "--num-layers must be a positive integer, got 0"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be a positive integer, got 0"),
    (["--use-torch-fsdp2", "--num-distributed-optimizer-instances", "0"],
     "--num-distributed-optimizer-instances must be a positive integer, got 0"),
    (["--num-distributed-optimizer-instances", "0"], "--num-distributed-optimizer-instances need --use-torch-fsdp2"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale must be a positive number"),
    (["--ffn-hidden-size", "30", "--tensor-model-parallel-size", "4"],
     "--ffn-hidden-size (30) must be divisible by --tensor-model-parallel-size (4)"),
    (["--kv-channels", "0"], "--kv-channels must be >= 1, got 0"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "4", "--seq-length", "30",
      "--max-position-embeddings", "32"], "--sequence-parallel needs --seq-length (30) divisible by"),
    (["--position-embedding-type", "rope", "--hidden-size", "12"],
     "RoPE rotates kv-channels x --rotary-percent = 3 x 1.0 = 3 dimensions: it must be a positive even number"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "--rotary-percent must be in (0, 1], got 1.5"),
    (["--hidden-dropout", "1.0"], "--hidden-dropout must be in [0, 1), got 1.0"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "rowwise", "--fp8-param-gather", "--use-torch-fsdp2"],
     "--fp8-param-gather=True with --fp8-recipe='rowwise' is not supported"),
    # Whatever else TransformerConfig checks, by building it.
    (["--recompute-granularity", "full"], "--recompute-granularity='full' needs --recompute-method 'uniform' or "
                                          "'block'"),
])
def test_model_shape_flags_are_usage_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(*flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    with pytest.raises(SystemExit) as exit_info:  # the other ranks stop alike, silently
        _parse(*flags, rank=1)
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize("flag", ["--torch-fsdp2-copy-kernels", "--no-torch-fsdp2-copy-kernels"])
def test_copy_kernel_flags_need_fsdp2(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parse(flag)
    assert exit_info.value.code == 2 and "--[no-]torch-fsdp2-copy-kernels" in capsys.readouterr().err


def test_every_config_is_built_once_right_after_parsing():
    from megatron_fsdp.distributed import TorchFullyShardedDataParallelConfig
    from megatron_fsdp.optimizer import OptimizerConfig
    from megatron_fsdp.transformer import TransformerConfig

    replicated = _parse("--bf16", "--lr", "3e-4", "--clip-grad", "0.5").configs
    assert isinstance(replicated.model, TransformerConfig) and replicated.model.bf16
    # Without --use-torch-fsdp2 the same wrapper replicates: a distributed-optimizer instance per
    # data-parallel rank (4), so the shard size is 1; the same fp32 reduction.
    assert isinstance(replicated.ddp, TorchFullyShardedDataParallelConfig)
    assert (replicated.ddp.num_distributed_optimizer_instances, replicated.ddp.reshard_after_forward,
            replicated.ddp.grad_reduce_in_fp32, replicated.ddp.fsdp_copy_kernels) == (4, False, True, False)
    assert isinstance(replicated.optimizer, OptimizerConfig)
    assert (replicated.optimizer.lr, replicated.optimizer.clip_grad, replicated.optimizer.bf16) == (3e-4, 0.5, True)
    assert replicated.scheduler["max_lr"] == 3e-4 and replicated.scheduler["lr_decay_steps"] == 4 * 8
    sharded = _parse("--use-torch-fsdp2", "--bf16", "--torch-fsdp2-no-reshard-after-forward").configs
    assert isinstance(sharded.ddp, TorchFullyShardedDataParallelConfig)
    assert (sharded.ddp.reshard_after_forward, sharded.ddp.grad_reduce_in_fp32, sharded.ddp.fsdp_copy_kernels) \
        == (False, True, True)  # Megatron: --bf16 reduces in fp32 unless --grad-reduce-in-bf16
    assert _parse("--hidden-size", "48").kv_channels == 12  # TransformerConfig's derived default, back in args


def test_copy_kernels_are_visible_in_the_flags():
    # On by default with --use-torch-fsdp2 (training.get_model turns None into True), off when asked.
    assert _parse("--use-torch-fsdp2").torch_fsdp2_copy_kernels is None
    assert _parse("--use-torch-fsdp2", "--no-torch-fsdp2-copy-kernels").torch_fsdp2_copy_kernels is False


def test_a_good_model_still_parses():
    args = _parse("--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "2",
                  "--position-embedding-type", "rope", "--swiglu", "--sequence-parallel")
    assert (args.num_query_groups, args.kv_channels, args.sequence_parallel) == (2, 16, True)


def test_heads_not_divisible_by_tp_stops_the_script_before_any_communication(monkeypatch, capfd):
    """The script run as torchrun starts it (rank 0 of 4; here in this process, with no rendezvous
    to reach and torch.distributed's start watched): one line and exit code 2 before any process
    group exists."""
    import runpy

    import torch.distributed as dist

    for name, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4").items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append("init_process_group"))
    script = os.path.join(ROOT, "examples", "pretrain_gpt.py")
    monkeypatch.setattr(sys, "argv", [script, *BASE, "--num-attention-heads", "6", "--hidden-size", "60",
                                      "--tensor-model-parallel-size", "4"])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(script, run_name="__main__")
    out, err = capfd.readouterr()
    assert exit_info.value.code == 2 and started == [] and out == ""
    assert err.strip().splitlines() == [
        "pretrain_gpt.py: error: --num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)"]


# ---------------------------------------------------------------------- more processes than GPUs


def _fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("backend, gpus, local_world_size, local_rank, expected", [
    ("nccl", 1, 4, 0, "4 processes on this node but 1 GPU visible; NCCL needs one GPU per process: start at most "
                      "1 per node (torchrun --nproc-per-node 1), or use --distributed-backend gloo to run on the CPU"),
    ("nccl", 2, 4, 3, "4 processes on this node but 2 GPUs visible"),
    ("nccl", 0, 1, 0, "the nccl backend needs GPUs and none is visible"),
    ("nccl", 4, 4, 3, None),
    ("nccl", 8, 2, 1, None),
    ("gloo", 0, 4, 0, None),
    ("gloo", 1, 4, 3, None),
])
def test_gpu_shortage(monkeypatch, backend, gpus, local_world_size, local_rank, expected):
    from megatron_fsdp.training.initialize import gpu_shortage
    _fake_gpus(monkeypatch, gpus)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    problem = gpu_shortage(backend, local_world_size, local_rank)
    assert problem == expected if expected is None else expected in problem, problem


@pytest.mark.parametrize("local_rank", [0, 2])
def test_more_processes_than_gpus_is_one_line_before_any_collective(monkeypatch, capsys, local_rank):
    """torchrun --nproc-per-node 4 on a 1-GPU machine with the NCCL backend (simulated): the
    node's first process prints one line, every process exits with code 2, and neither the
    process group nor the device is touched."""
    from megatron_fsdp.training import initialize
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    touched = []
    monkeypatch.setattr(initialize.dist, "init_process_group", lambda *a, **k: touched.append("init_process_group"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a, **k: touched.append("set_device"))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    with pytest.raises(SystemExit) as exit_info:
        initialize.initialize_distributed(Namespace(distributed_backend=None, distributed_timeout_minutes=10))
    assert exit_info.value.code == 2 and touched == []
    err = capsys.readouterr().err.strip().splitlines()
    if local_rank == 0:
        assert err == ["pretrain_gpt.py: error: 4 processes on this node but 1 GPU visible (CUDA_VISIBLE_DEVICES=0); "
                       "NCCL needs one GPU per process: start at most 1 per node (torchrun --nproc-per-node 1), "
                       "or use --distributed-backend gloo to run on the CPU"], err
    else:
        assert err == []


def test_help_shows_megatrons_groups_with_a_line_and_the_default_of_every_flag(capsys):
    import argparse

    from megatron_fsdp.training.argument_groups import add_megatron_arguments

    parser = argparse.ArgumentParser()
    add_megatron_arguments(parser)
    titles = [g.title for g in parser._action_groups if g._group_actions]
    assert {"network size", "regularization", "training", "learning rate", "checkpointing", "mixed precision",
            "distributed", "validation", "data and dataloader", "tokenizer", "logging"} <= set(titles)
    flags = [a for g in parser._action_groups if g.title not in ("options", "optional arguments")
             for a in g._group_actions]
    assert len(flags) > 140 and all(a.help and "\n" not in a.help for a in flags), \
        [a.option_strings for a in flags if not a.help]
    with pytest.raises(SystemExit) as exit_info:
        _parse("--help")
    out = " ".join(capsys.readouterr().out.split())  # as one line: the formatter wraps anywhere
    assert exit_info.value.code == 0
    assert out.count("(default: ") == len(flags)  # the formatter adds each default once
    assert "network size:" in out and "--fp8-param-gather" in out
