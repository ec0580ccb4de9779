"""GPTModel with context parallelism against the dense one-process reference (tests/reference_gpt.py):
each CP rank runs its two load-balanced chunks of every sequence (get_batch_on_this_cp_rank), and its
per-token losses are the reference's at those positions; the gradients, summed over the CP group
(each rank's tokens contribute their part), are the reference's. Causal, GQA, RoPE, SwiGLU, fp32."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import reference_gpt
from helpers import FP32_TOLERANCE, assert_close_dicts, batch, full_grads, full_params, make_config, setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp._torch_compat import local_tensor
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.utils import get_batch_on_this_cp_rank, split_for_cp_rank

VOCAB = 64
GRAD_NORM = re.compile(r"iteration\s+(\d+)/.*\| grad norm: ([\d.E+-]+) \|")
VARIANTS = {
    "gqa_swiglu_rope": dict(
        config=dict(num_attention_heads=8, num_query_groups=4, gated_linear_unit=True, activation_func=F.silu,
                    normalization="RMSNorm", add_bias_linear=False),
        model=dict(position_embedding_type="rope")),
    "learned_positions": dict(config=dict(), model=dict()),
}


def _case_cp_parity(tp: int, sequence_parallel: bool, comm_type: str, variant: str) -> None:
    cp = dist.get_world_size() // tp
    # a2a+p2p: at CP 4, 2 a2a x 2 p2p; at CP 2, the a2a alone (the ring of one is p2p's own test)
    sizes = ([2, cp // 2] if comm_type == "a2a+p2p" else None)
    setup_parallel(tp, context_parallel_size=cp, hierarchical_context_parallel_sizes=sizes)
    spec = VARIANTS[variant]
    cfg = make_config(sequence_parallel=sequence_parallel, context_parallel_size=cp, cp_comm_type=comm_type,
                      hierarchical_context_parallel_sizes=sizes, **spec["config"])
    model_kwargs = dict(vocab_size=VOCAB, max_sequence_length=16, **spec["model"])
    model = GPTModel(cfg, **model_kwargs)
    ids, labels, positions, weights = batch(VOCAB)
    mine = get_batch_on_this_cp_rank({"tokens": ids, "labels": labels, "position_ids": positions.contiguous(),
                                      "weights": weights})
    loss = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
    (loss * mine["weights"]).sum().backward()
    cp_group = parallel_state.get_context_parallel_group()
    for p in model.parameters():
        dist.all_reduce(local_tensor(p.grad), group=cp_group)  # each CP rank's tokens give part of every gradient
    grads, params = full_grads(model), full_params(model)

    ref_params = {name: p.clone().requires_grad_(True) for name, p in params.items()}
    ref_loss = reference_gpt.gpt_forward(
        ref_params, cfg, ids, labels, position_embedding_type=model_kwargs.get("position_embedding_type",
                                                                                "learned_absolute"))
    (ref_loss * weights).sum().backward()
    rank = parallel_state.get_context_parallel_rank()
    torch.testing.assert_close(loss.detach(), split_for_cp_rank(ref_loss.detach(), 1, cp, rank), **FP32_TOLERANCE)
    assert_close_dicts(grads, {n: p.grad for n, p in ref_params.items()}, "gradient")


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a", "a2a+p2p"])
@pytest.mark.parametrize("world_size,tp,sequence_parallel,variant", [
    (2, 1, False, "learned_positions"),     # CP 2
    (4, 1, False, "gqa_swiglu_rope"),       # CP 4
    (4, 2, True, "gqa_swiglu_rope"),        # TP 2 with sequence parallelism x CP 2
])
def test_gpt_with_context_parallelism_matches_the_dense_reference(pools, comm_type, world_size, tp,
                                                                  sequence_parallel, variant):
    pools(world_size).run(_case_cp_parity, tp, sequence_parallel, comm_type, variant)


def _case_an_explicit_mask_is_refused():
    setup_parallel(1, context_parallel_size=2)
    model = GPTModel(make_config(context_parallel_size=2, cp_comm_type="all_gather"), vocab_size=VOCAB,
                     max_sequence_length=16)
    ids, labels, positions, _ = batch(VOCAB, s=8)
    model(ids, positions, torch.zeros(2, 1, 8, 16, dtype=torch.bool), labels=labels)


def test_an_explicit_attention_mask_is_refused_in_one_line(pools):
    errors = pools(2).run_expecting_errors(_case_an_explicit_mask_is_refused)
    assert all(e.type_name == "NotImplementedError" and "--context-parallel-size > 1" in e.message
               for e in errors), errors[0].message


@pytest.mark.slow  # pretrain() jobs in the worker pool
@pytest.mark.parametrize("comm_type,cp_size,extra", [
    # (all_gather's and a2a's pretrain runs are in the compositions step: their attention has its
    # parity tests in the suite)
    ("p2p", 2, []), pytest.param("all_gather", 2, [], marks=pytest.mark.compositions),
    pytest.param("a2a", 2, [], marks=pytest.mark.compositions),
    ("a2a+p2p", 4, ["--hierarchical-context-parallel-sizes", "2", "2"]),  # DP 1 x CP 4: 2 a2a x 2 p2p
])
def test_pretrain_with_context_parallelism_repeats_dp2_step_for_step(pools, comm_type, cp_size, extra):
    """examples/pretrain_gpt.py with --context-parallel-size (FSDP over the flattened DP x CP ranks,
    the loss reported over DP x CP), 4 ranks: the same losses, iteration by iteration, as DP 2 alone."""
    from test_training import LINE, _pretrain

    run = ["--train-iters", "4", "--eval-iters", "0"]
    plain = _pretrain(pools, 2, *run)
    cp = _pretrain(pools, 4, *run, "--context-parallel-size", str(cp_size), "--cp-comm-type", comm_type, *extra)
    # (DP 4 would give the same losses too: the layout line says how the job ran)
    layout = f"tensor-parallel 1 x context-parallel {cp_size} ({comm_type}) x data-parallel {4 // cp_size} on"
    assert layout in cp.stdout, cp.stdout[-2000:]
    losses = [{int(m[1]): float(m[6]) for m in map(LINE.search, job.stdout.splitlines()) if m} for job in (plain, cp)]
    assert sorted(losses[0]) == [1, 2, 3, 4] and losses[1].keys() == losses[0].keys(), losses
    for iteration, loss in losses[0].items():
        assert losses[1][iteration] == pytest.approx(loss, rel=1e-5), (iteration, losses)
    # The gradient's scale too (Adam and clipping hide a gradient off by the CP factor from the losses).
    norms = [{int(m[1]): float(m[2]) for m in map(GRAD_NORM.search, job.stdout.splitlines()) if m}
             for job in (plain, cp)]
    assert sorted(norms[0]) == [1, 2, 3, 4], norms
    for iteration, norm in norms[0].items():
        assert norms[1][iteration] == pytest.approx(norm, abs=2e-3), (iteration, norms)  # printed: 3 decimals


@pytest.mark.parametrize("flags, message", [
    (["--context-parallel-size", "3"], "world size 4 is not divisible by --tensor-model-parallel-size 1 x "
                                       "--context-parallel-size 3"),
    (["--context-parallel-size", "4", "--seq-length", "36", "--max-position-embeddings", "36"],
     "--context-parallel-size 4 needs --seq-length (36) divisible by 2 x --context-parallel-size (8)"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "36",
      "--max-position-embeddings", "36"],
     "divisible by 2 x --context-parallel-size x --tensor-model-parallel-size with --sequence-parallel (8)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "p2p"],
     "--cp-comm-type takes one value or one per layer (2), got 3"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-attention-heads", "2", "--hidden-size", "64"],
     "--cp-comm-type 'a2a' needs the attention heads (2) and query groups (2) of a tensor-parallel rank divisible by "
     "--context-parallel-size (4)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "ring"], "--cp-comm-type 'ring' is not one of p2p, all_gather, a2a, a2a+p2p"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"],
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A R: the a2a and p2p group sizes, positive, "
     "with A x R = --context-parallel-size (4); got None"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "3"],
     "with A x R = --context-parallel-size (4); got [2, 3]"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1",
      "--num-attention-heads", "2", "--hidden-size", "64"],
     "--cp-comm-type 'a2a+p2p' needs the attention heads (2) and query groups (2) of a tensor-parallel rank divisible "
     "by the a2a size (4)"),
    (["--hierarchical-context-parallel-sizes", "1", "2"], "--hierarchical-context-parallel-sizes goes with --cp-comm-type"),
    (["--context-parallel-size", "2", "--reset-attention-mask"],
     "--reset-attention-mask is not supported with --context-parallel-size > 1"),
    (["--no-fsdp", "--context-parallel-size", "2"], "--context-parallel-size > 1 needs --use-torch-fsdp2"),
    (["--context-parallel-size", "2", "--num-distributed-optimizer-instances", "2"],
     "--context-parallel-size > 1 with --num-distributed-optimizer-instances > 1 (HSDP) is not supported"),
])
def test_bad_context_parallel_flags_are_one_line_before_any_work(flags, message, capsys):
    from test_usage_errors import _parse

    flags = flags[1:] if flags[0] == "--no-fsdp" else ["--use-torch-fsdp2", *flags]
    with pytest.raises(SystemExit) as exit_info:
        _parse(*flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err


def test_good_context_parallel_flags():
    from test_usage_errors import _parse

    args = _parse("--use-torch-fsdp2", "--context-parallel-size", "2", "--cp-comm-type", "a2a")
    assert args.data_parallel_size == 2 and args.cp_comm_type == "a2a"
    assert _parse("--use-torch-fsdp2", "--context-parallel-size", "2", "--cp-comm-type", "a2a",
                  "p2p").cp_comm_type == ["a2a", "p2p"]


@pytest.mark.slow  # pretrain() jobs in the worker pool
def test_checkpoints_are_context_parallel_invariant(pools, tmp_path):
    """Saved at DP 2 x CP 2, resumed at CP 1 (DP 2) and at CP 4 (DP 1); saved at CP 1, resumed at
    CP 2: each continues with the losses of the run it resumes (the same full weights and
    optimizer state at any CP size)."""
    from test_training import LINE, _pretrain

    def losses(job):
        return {int(m[1]): float(m[6]) for m in map(LINE.search, job.stdout.splitlines()) if m}

    def tracker_to(ckpt, iteration):
        with open(tmp_path / ckpt / "latest_checkpointed_iteration.txt", "w") as f:
            f.write(f"{iteration}\n")

    run = ["--train-iters", "4", "--eval-iters", "0", "--cp-comm-type", "all_gather"]
    saved_at_cp2 = losses(_pretrain(pools, 4, *run, "--context-parallel-size", "2", "--save",
                                    str(tmp_path / "cp2"), "--save-interval", "2"))
    saved_at_cp1 = losses(_pretrain(pools, 2, *run, "--save", str(tmp_path / "cp1"), "--save-interval", "2"))
    tracker_to("cp2", 2)
    tracker_to("cp1", 2)
    resumed = {
        "cp2 -> cp1": (losses(_pretrain(pools, 2, *run, "--load", str(tmp_path / "cp2"))), saved_at_cp2),
        "cp2 -> cp4": (losses(_pretrain(pools, 4, *run, "--context-parallel-size", "4", "--load",
                                        str(tmp_path / "cp2"))), saved_at_cp2),
        "cp1 -> cp2": (losses(_pretrain(pools, 4, *run, "--context-parallel-size", "2", "--load",
                                        str(tmp_path / "cp1"))), saved_at_cp1),
    }
    for how, (got, reference) in resumed.items():
        assert sorted(got) == [3, 4], (how, got)
        for iteration in (3, 4):
            assert got[iteration] == pytest.approx(reference[iteration], rel=1e-5), (how, got, reference)


@pytest.mark.e2e
@pytest.mark.compositions  # the README's command: CI's compositions step
def test_the_readmes_long_context_command_runs_as_written(tmp_path):
    """README's "Long context" command, as written: CP 2 x DP 2 on 4 processes."""
    import re

    from helpers import run_readme_command

    proc = run_readme_command("Long context")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tensor-parallel 1 x context-parallel 2 (a2a) x data-parallel 2" in proc.stdout
    assert re.search(r"iteration\s+10/\s+10 \|.*lm loss: [\d.E+]+ \|", proc.stdout), proc.stdout[-2000:]


COMPOSITIONS = {
    # The loss mask differs between the CP ranks' chunks: the gradient must not depend on how.
    "eod_mask_loss": dict(drop=[], add=["--eod-mask-loss"], rel=1e-5),
    "recompute": dict(drop=[], add=["--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"], rel=1e-5),
    "fp8": dict(drop=[], add=["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed",
                              "--fp8-amax-history-len", "4"], rel=1e-3),  # bf16: 2.5e-4 seen
}


def _composition_job(pools, nproc: int, composition: str, *args: str):
    from test_training import MODEL, RUN, _Job
    from pretrain_in_pool import pretrain_gpt_job

    spec = COMPOSITIONS[composition]
    argv = [*MODEL, *[a for a in RUN if a not in spec["drop"]], *spec["add"], "--train-iters", "4",
            "--eval-iters", "0", *args]
    outcomes = pools(nproc).run(pretrain_gpt_job, argv, timeout=400)
    out = "".join(text for _, text in outcomes)
    assert all(code == 0 for code, _ in outcomes), out[-3000:]
    return _Job(out)


@pytest.mark.slow  # pretrain() jobs in the worker pool
@pytest.mark.compositions
@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_context_parallelism_composes(pools, composition):
    """DP 2 x CP 2 against DP 2 with the same flags: full activation recompute, fp8 with delayed scaling (the amax reduced
    over TP x CP: the whole sequence's, as at DP 2; bf16, so to bf16's precision)."""
    from test_training import LINE

    plain = _composition_job(pools, 2, composition)
    cp = _composition_job(pools, 4, composition, "--context-parallel-size", "2", "--cp-comm-type", "p2p")
    assert "context-parallel 2 (p2p) x data-parallel 2" in cp.stdout
    losses = [{int(m[1]): float(m[6]) for m in map(LINE.search, job.stdout.splitlines()) if m} for job in (plain, cp)]
    norms = [{int(m[1]): float(m[2]) for m in map(GRAD_NORM.search, job.stdout.splitlines()) if m}
             for job in (plain, cp)]
    assert sorted(losses[0]) == [1, 2, 3, 4] and losses[1].keys() == losses[0].keys(), losses
    for iteration, loss in losses[0].items():
        assert losses[1][iteration] == pytest.approx(loss, rel=COMPOSITIONS[composition]["rel"]), (iteration, losses)
        # (printed with 3 decimals; bf16 fp8: 1.1% seen)
        norm_tolerance = dict(rel=3e-2) if composition == "fp8" else dict(abs=2e-3)
        assert norms[1][iteration] == pytest.approx(norms[0][iteration], **norm_tolerance), (iteration, norms)


@pytest.mark.slow  # compiles on 2 cores
@pytest.mark.compositions
def test_context_parallel_layers_compile_and_train_like_eager_ones(pools):
    """--torch-compile at DP 2 x CP 2 (p2p: the ring's point-to-point ops and autograd function
    inside each compiled TransformerLayer), traced under aot_eager as tests/test_torch_compile.py
    does: the losses equal eager's bit for bit, and the compiled layers ran."""
    from test_torch_compile import train_eager_and_compiled
    from test_training import MODEL, RUN

    runs = train_eager_and_compiled(pools, 4, [*MODEL, *RUN, "--train-iters", "3", "--eval-iters", "0",
                                               "--context-parallel-size", "2", "--cp-comm-type", "p2p"])
    losses = {compiled: losses for compiled, (losses, _) in runs.items()}
    assert len(losses[False]) == 3 and losses[True] == losses[False], losses


def _case_a_rank_whose_tokens_are_all_masked():
    from megatron_fsdp.pipeline_parallel.schedules import forward_backward_no_pipelining

    setup_parallel(1, context_parallel_size=2)
    model = GPTModel(make_config(context_parallel_size=2, cp_comm_type="p2p"), vocab_size=VOCAB,
                     max_sequence_length=16)
    ids, labels, positions, _ = batch(VOCAB)
    loss_mask = torch.zeros(2, 16)
    loss_mask[:, :4] = loss_mask[:, 12:] = 1  # chunks 0 and 3: CP rank 0's; rank 1 (chunks 1, 2) has none
    mine = get_batch_on_this_cp_rank({"tokens": ids, "labels": labels, "position_ids": positions.contiguous(),
                                      "loss_mask": loss_mask})

    def loss_func(mask, output):
        loss = (output.view(-1).float() * mask.view(-1)).sum()
        tokens = mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1).float()])}

    def forward_step(data_iterator, model):
        return model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"]), \
            lambda output: loss_func(mine["loss_mask"], output)

    params = full_params(model)
    reports = forward_backward_no_pipelining(forward_step_func=forward_step, data_iterator=iter([None]),
                                             model=model, num_microbatches=1)
    assert mine["loss_mask"].sum() == (0 if parallel_state.get_context_parallel_rank() == 1 else 16)
    for p in model.parameters():
        assert torch.isfinite(local_tensor(p.grad)).all()
        # What FSDP does over DP x CP: the average of the ranks' gradients.
        dist.all_reduce(local_tensor(p.grad), group=parallel_state.get_context_parallel_group())
        local_tensor(p.grad).div_(2)
    # The gradient of the whole sequences' per-token mean loss, as at CP 1 (not half of it: rank 1
    # has no tokens; not weighted by each rank's own count either).
    ref_params = {name: p.clone().requires_grad_(True) for name, p in params.items()}
    ref_loss = reference_gpt.gpt_forward(ref_params, model.config, ids, labels)
    ((ref_loss * loss_mask).sum() / loss_mask.sum()).backward()
    assert_close_dicts(full_grads(model), {n: p.grad for n, p in ref_params.items()}, "gradient")
    return torch.isfinite(reports[0]["lm loss"]).all().item()


def test_a_context_parallel_rank_whose_tokens_are_all_masked_gives_no_nan(pools):
    """Megatron-LM #1764: a CP rank whose every token is masked out of the loss adds zero, not NaN;
    and the gradient is the whole sequences' per-token mean's, as at CP 1 (each rank dividing by its
    own token count gave half of it here, and with uneven masks a gradient that changed with CP)."""
    assert pools(2).run(_case_a_rank_whose_tokens_are_all_masked) == [True, True]


def _case_nvidia_fully_shard_over_dp_x_cp():
    from megatron_fsdp.fully_shard import fully_shard_model

    setup_parallel(1, context_parallel_size=2)
    cfg = make_config(context_parallel_size=2, cp_comm_type="p2p", **VARIANTS["gqa_swiglu_rope"]["config"])
    model = GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=16, position_embedding_type="rope")
    params = full_params(model)
    # NVIDIA Megatron-FSDP's way: dp_shard_dim names the flattened data- x context-parallel dimension.
    model = fully_shard_model(model, device_mesh=parallel_state.get_device_mesh(), dp_shard_dim="dp_shard_cp",
                              tp_dim="tp")
    ids, labels, positions, weights = batch(VOCAB)
    mine = get_batch_on_this_cp_rank({"tokens": ids, "labels": labels, "position_ids": positions.contiguous(),
                                      "weights": weights})
    loss = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"])
    (loss * mine["weights"]).sum().backward()
    if hasattr(model, "finish_grad_sync"):
        model.finish_grad_sync()
    grads = {name.removeprefix("module."): p.grad.full_tensor() for name, p in model.named_parameters()}

    ref_params = {name: p.clone().requires_grad_(True) for name, p in params.items()}
    ref_loss = reference_gpt.gpt_forward(ref_params, cfg, ids, labels, position_embedding_type="rope")
    (ref_loss * weights).sum().backward()
    # FSDP averages the gradient over its 2 ranks (the CP ranks here): half the whole sequence's.
    assert_close_dicts(grads, {n: p.grad / 2 for n, p in ref_params.items()}, "gradient")


def test_nvidias_fully_shard_shards_over_the_flattened_dp_x_cp_mesh(pools):
    pools(2).run(_case_nvidia_fully_shard_over_dp_x_cp)


def _case_meta_init_at_tp2_x_cp2():
    from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
    from megatron_fsdp.initialization import initialize_parameters

    setup_parallel(2, context_parallel_size=2)
    cfg = make_config(sequence_parallel=True, context_parallel_size=2, cp_comm_type="p2p")
    with torch.device("meta"):
        model = GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=16, position_embedding_type="rope")
    wrapped = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(), model)
    sharded = full_params(wrapped.module)
    parallel_state.destroy_model_parallel()
    setup_parallel(1)
    with torch.device("meta"):
        whole = GPTModel(make_config(), vocab_size=VOCAB, max_sequence_length=16, position_embedding_type="rope")
    whole.to_empty(device="cpu")
    initialize_parameters(whole)
    assert_close_dicts(sharded, full_params(whole), "meta-initialized weight", rtol=0, atol=0)


def test_meta_init_gives_the_same_weights_with_context_parallelism(pools):
    """A meta-device model wrapped at TP 2 x CP 2 (FSDP over the CP ranks) gets, rank by rank, its
    part of the weights one whole model initialized in one process gets."""
    pools(4).run(_case_meta_init_at_tp2_x_cp2)


def test_generation_refuses_context_parallelism_in_one_line(monkeypatch, capsys):
    """examples/generate_gpt.py runs at CP 1 (the whole prompt on every rank): another CP size is
    refused before start-up, not run as if the prompt were this rank's chunks."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "examples"))
    import generate_gpt

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(generate_gpt, "check_launched_by_torchrun", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["generate_gpt.py", "--load", "ckpt", "--num-layers", "2", "--hidden-size", "32",
                                      "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "64",
                                      "--micro-batch-size", "1", "--use-torch-fsdp2", "--context-parallel-size", "2",
                                      "--prompts", "hello"])
    with pytest.raises(SystemExit) as exit_info:
        generate_gpt.main()
    assert "generate_gpt.py runs at --context-parallel-size 1 (got 2)" in str(exit_info.value.code)
