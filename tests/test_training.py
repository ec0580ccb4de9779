"""megatron_fsdp.training.pretrain through examples/pretrain_gpt.py: TensorBoard scalars
with Megatron's names, TFLOP/s equal to Megatron's formula, and a resume at another
data-parallel size that continues with the same samples, and the one-line errors of jobs
that must stop. The jobs run in the worker pool (tests/pretrain_in_pool.py): torchrun's own
part of an error is tests/test_training_faults.py's."""

import glob
import importlib.util
import math
import os
import re
import shutil

import pytest

from helpers import spoil_tensor_data
from job_output import assert_one_line_error_in_pool, error_lines
from pretrain_in_pool import pretrain_gpt_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--swiglu", "--ffn-hidden-size", "96", "--seq-length", "16",
         "--position-embedding-type", "rope", "--hidden-dropout", "0", "--attention-dropout", "0"]
RUN = ["--use-torch-fsdp2", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
       "--train-iters", "6", "--mock-data", "--vocab-size", "64", "--log-interval", "1", "--log-throughput",
       "--eval-interval", "3", "--eval-iters", "1", "--num-workers", "0", "--seed", "5"]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # Megatron-LM's defaults (MODEL has none)
LINE = re.compile(r"iteration\s+(\d+)/\s+\d+ \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): "
                  r"([\d.]+) \| throughput per GPU \(TFLOP/s/GPU\): ([\d.]+) \| throughput per GPU "
                  r"\(tokens/s/GPU\): ([\d.]+) \|.*\| lm loss: ([\d.E+-]+) \|")
HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


class _Job:
    def __init__(self, stdout: str):
        self.stdout = stdout


def _pretrain(pools, nproc: int, *args: str) -> _Job:
    """The job on `nproc` ranks of the worker pool; its stdout as torchrun shows it (every rank's)."""
    outcomes = pools(nproc).run(pretrain_gpt_job, [*MODEL, *RUN, *args], timeout=400)
    out = "".join(text for _, text in outcomes)
    assert all(code == 0 for code, _ in outcomes), f"exit codes {[c for c, _ in outcomes]}\n{out[-3000:]}"
    return _Job(out)


def _flops_per_iteration(batch=8, s=16, layers=2, h=48, f=96, heads=4, groups=2, vocab=256):
    """Megatron-LM's dense-GPT count for MODEL (SwiGLU, GQA, causal), vocabulary 64 padded to a multiple of 128 x TP 2."""
    kv_channels = h // heads
    q, kv = kv_channels * heads, kv_channels * groups
    per_token_layer = 3 * 2 * h * f + 2 * h * q + 2 * 2 * h * kv + 2 * q * h + 2 * s * q
    return 3 * batch * s * (layers * per_token_layer + 2 * h * vocab)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, pools):
    """4 ranks, TP=2 x FSDP=2, a checkpoint at iteration 3, TensorBoard when installed."""
    tmp = tmp_path_factory.mktemp("run")
    extra = ["--tensorboard-dir", str(tmp / "tb"), "--log-timers-to-tensorboard",
             "--log-validation-ppl-to-tensorboard"] if HAVE_TENSORBOARD else []
    proc = _pretrain(pools, 4, "--tensor-model-parallel-size", "2", "--save", str(tmp / "ckpt"), "--save-interval", "3",
                     *extra)
    rows = {int(m[1]): m for m in map(LINE.search, proc.stdout.splitlines()) if m}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6], proc.stdout[-3000:]
    return tmp, rows, proc.stdout


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_log_line_throughput_is_megatrons_formula(reference):
    _, rows, out = reference
    for iteration, m in rows.items():
        assert int(m[2]) == 8 * iteration  # consumed samples
        seconds = float(m[3]) / 1000
        # TFLOP/s is printed to 3 significant digits, the time to 0.1 ms.
        assert float(m[4]) == pytest.approx(_flops_per_iteration() / (seconds * 1e12 * 4), rel=6e-3)
        assert float(m[5]) == pytest.approx(8 * 16 / (seconds * 4), rel=2e-3, abs=0.06)
    assert re.search(r"validation loss at iteration 3 \| lm loss value: [\d.E+-]+ \| lm loss PPL: [\d.E+-]+ \|", out)
    assert "validation loss at iteration 6 on test set | lm loss value: " in out
    assert "(after 1 iterations) memory (MB)" in out


@pytest.mark.slow  # a pretrain() job in the worker pool
@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_gets_megatrons_scalars(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, rows, _ = reference
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"learning-rate", "learning-rate vs samples", "batch-size", "batch-size vs samples", "lm loss",
                "lm loss vs samples", "loss-scale", "loss-scale vs samples", "grad-norm", "grad-norm vs samples",
                "iteration-time", "throughput", "lm loss validation", "lm loss validation vs samples",
                "lm loss validation ppl", "lm loss validation ppl vs samples"}
    assert expected <= tags, sorted(expected - tags)
    losses = {e.step: e.value for e in events.Scalars("lm loss")}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step, m in rows.items():  # log interval 1: the line's mean is the iteration's loss
        assert losses[step] == pytest.approx(float(m[6]), rel=1e-6)
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8, 16, 24, 32, 40, 48]
    # Full precision: throughput is exactly the formula over the logged iteration time.
    times = {e.step: e.value for e in events.Scalars("iteration-time")}
    for e in events.Scalars("throughput"):
        assert e.value == pytest.approx(_flops_per_iteration() / (times[e.step] * 1e12 * 4), rel=1e-5)
    validation = {e.step: e.value for e in events.Scalars("lm loss validation")}
    ppl = {e.step: e.value for e in events.Scalars("lm loss validation ppl")}
    assert sorted(validation) == [3, 6] and ppl[3] == pytest.approx(math.exp(validation[3]), rel=1e-5)


@pytest.mark.slow  # pretrain() jobs in the worker pool
def test_a_resume_with_dropout_repeats_the_uninterrupted_run_bit_for_bit(tmp_path, pools):
    """Megatron's default dropout on CPU, a cyclic data loader with worker processes (each epoch
    an iter() of the loader), and evaluations before and after the checkpoint: resumed at
    iteration 3, the run repeats the uninterrupted one's losses, training and validation, bit for
    bit. (Data loaders built after the RNG states were restored once drew from the generator
    dropout uses.)"""
    run = [*DROPOUT, "--dataloader-type", "cyclic", "--num-workers", "2", "--eval-interval", "2", "--eval-iters", "1"]
    ckpt = str(tmp_path / "ckpt")
    first = _pretrain(pools, 2, *run, "--save", ckpt, "--save-interval", "3")
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3\n")
    resumed = _pretrain(pools, 2, *run, "--load", ckpt)
    validation = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([\d.E+-]+)")
    losses, evaluations = ([{int(m[1]): m[pick] for m in map(pattern.search, proc.stdout.splitlines()) if m}
                            for proc in (first, resumed)] for pattern, pick in ((LINE, 6), (validation, 2)))
    assert sorted(losses[0]) == [1, 2, 3, 4, 5, 6] and sorted(losses[1]) == [4, 5, 6], losses
    assert losses[1] == {k: v for k, v in losses[0].items() if k > 3}
    assert sorted(evaluations[0]) == [2, 4, 6] and evaluations[1] == {k: v for k, v in evaluations[0].items() if k > 3}


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_resume_at_another_data_parallel_size_reads_the_same_samples(reference, pools):
    """Saved at iteration 3 by TP=2 x DP=2, resumed by TP=2 x DP=1 (twice the
    microbatches): iterations 4-6 see the same global batches, so the losses
    agree to reduction-order precision."""
    tmp, rows, _ = reference
    with open(tmp / "ckpt" / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("3\n")  # as if the run had stopped after iteration 3
    resumed = _pretrain(pools, 2, "--tensor-model-parallel-size", "2", "--load", str(tmp / "ckpt"),
                        "--eval-iters", "0")
    out = resumed.stdout
    assert "loaded checkpoint" in out and "at iteration 3" in out
    assert "padded vocabulary" not in out  # same TP size: same padding
    got = {int(m[1]): m for m in map(LINE.search, out.splitlines()) if m}
    assert sorted(got) == [4, 5, 6]
    for iteration in (4, 5, 6):
        assert got[iteration][2] == rows[iteration][2]  # consumed samples continue from the checkpoint
        assert float(got[iteration][6]) == pytest.approx(float(rows[iteration][6]), rel=2e-5)


def _failing(pools, nproc: int, *args: str) -> list[tuple]:
    """A job that must fail, on `nproc` ranks of the worker pool: each rank's exit code, stdout,
    stderr and torchrun error file (the one-line error's checks: job_output)."""
    return pools(nproc).run(pretrain_gpt_job, [*MODEL, *RUN, *args], True, timeout=400)


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_resume_with_other_model_flags_is_refused_before_loading(reference, pools):
    """A different --hidden-size changes the weights' shapes: the error names the flag (from the
    checkpoint's recorded flags), not a shape mismatch deep in the loader, on every rank."""
    tmp, _, _ = reference
    outcomes = _failing(pools, 2, "--hidden-size", "64", "--load", str(tmp / "ckpt"), "--eval-iters", "0")
    assert_one_line_error_in_pool(outcomes, "saved with other model flags: --hidden-size 48 (now 64)")


def _checkpoint_at_iteration_3(reference, tmp_path) -> str:
    """A copy of the reference run's checkpoints whose tracker names iteration 3."""
    tmp, _, _ = reference
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tmp / "ckpt", ckpt)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3\n")
    return ckpt


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_a_changed_schedule_is_refused_before_any_tensor_is_read(reference, tmp_path, pools):
    """--train-iters 8 where the checkpoint's run had 6 (a longer decay) without
    --override-opt-param-scheduler or --use-checkpoint-opt-param-scheduler: the error comes from
    the checkpoint's non-tensor entries alone. Every tensor's bytes are spoiled here, so reading
    (or checksumming) any of them first would fail differently."""
    ckpt = _checkpoint_at_iteration_3(reference, tmp_path)
    assert spoil_tensor_data(os.path.join(ckpt, "iter_0000003")) > 0
    outcomes = _failing(pools, 1, "--train-iters", "8", "--load", ckpt, "--eval-iters", "0")
    assert_one_line_error_in_pool(outcomes, "the learning-rate schedule differs from the checkpoint's: "
                                  "OptimizerParamScheduler: this run's lr_decay_steps (total number of iterations) is "
                                  "64 but the checkpoint's is 48")
    assert "--override-opt-param-scheduler" in error_lines(outcomes[0][2])[0][3]


def _job_recording_warnings(argv):
    """pretrain_gpt_job(argv) and the warnings its rank raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out = pretrain_gpt_job(argv)
    return code, out, [f"{w.category.__name__}: {w.message}" for w in caught]


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_a_resume_warns_nothing(reference, tmp_path, pools):
    """torch's "torch.distributed is disabled ... assuming the intent is to load in a single process"
    came twice on every rank of every resume (each rank reads its own entries without a group)."""
    ckpt = _checkpoint_at_iteration_3(reference, tmp_path)
    outcomes = pools(2).run(_job_recording_warnings, [*MODEL, *RUN, "--tensor-model-parallel-size", "2", "--load",
                                                      ckpt, "--eval-iters", "0"], timeout=400)
    assert [code for code, _, _ in outcomes] == [0, 0], outcomes[0][1][-2000:]
    assert "loaded checkpoint" in "".join(out for _, out, _ in outcomes)
    assert [said for _, _, said in outcomes] == [[], []]


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_a_run_whose_checkpoint_reached_train_iters_says_there_is_nothing_to_train(reference, tmp_path, pools):
    tmp, _, _ = reference
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tmp / "ckpt", ckpt)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("6\n")  # the reference run's last save
    out = _pretrain(pools, 2, "--tensor-model-parallel-size", "2", "--load", ckpt, "--eval-iters", "0").stdout
    assert "> nothing to train: the checkpoint loaded is at iteration 6 and --train-iters is 6" in out, out[-2000:]
    assert "training ..." not in out and not LINE.search(out)


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_a_corrupt_checkpoint_is_one_line_that_names_the_file(reference, tmp_path, pools):
    """A shard cut short: the job's one-line error names it (the first of the files, and how many more)."""
    ckpt = _checkpoint_at_iteration_3(reference, tmp_path)
    shards = sorted(glob.glob(os.path.join(ckpt, "iter_0000003", "*.distcp")))
    for shard in shards[:2]:
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    outcomes = _failing(pools, 2, "--tensor-model-parallel-size", "2", "--load", ckpt, "--eval-iters", "0")
    assert_one_line_error_in_pool(outcomes, f"is corrupt: a file differs from what was saved: {shards[0]}: ")
    assert "(and 1 more file(s), in the full error)" in error_lines(outcomes[0][2] + outcomes[1][2])[0][3]


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_a_resume_at_another_tp_size_warns_once_that_the_padded_vocabulary_changed(reference, tmp_path, pools):
    """Saved at TP=2 (vocabulary 64 padded to 256 rows), resumed at TP=1 (128 rows): the padding
    logits enter the softmax as in Megatron, so the loss moves; rank 0 says so, once, and how to
    keep the padding. With that flag the run continues with the saved run's losses."""
    ckpt = _checkpoint_at_iteration_3(reference, tmp_path)
    _, rows, _ = reference
    kept = _pretrain(pools, 2, "--tensor-model-parallel-size", "1", "--make-vocab-size-divisible-by", "256",
                     "--load", ckpt, "--eval-iters", "0")
    assert "padded vocabulary" not in kept.stdout
    got = {int(m[1]): float(m[6]) for m in map(LINE.search, kept.stdout.splitlines()) if m}
    assert got == pytest.approx({i: float(rows[i][6]) for i in (4, 5, 6)}, rel=2e-5)

    resumed = _pretrain(pools, 2, "--tensor-model-parallel-size", "1", "--load", ckpt, "--eval-iters", "0")
    warnings = [line for line in resumed.stdout.splitlines() if "padded vocabulary" in line]
    assert warnings == ["> WARNING: the padded vocabulary is 128 rows, the checkpoint's 256 (it is padded to a "
                        "multiple of --make-vocab-size-divisible-by x --tensor-model-parallel-size): the padding "
                        "logits enter the softmax, as in Megatron, so the loss will not continue from the saved "
                        "run's value (--make-vocab-size-divisible-by 256 keeps the checkpoint's padding)"], \
        resumed.stdout[-3000:]


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_fp8_training_resumes_exactly(tmp_path, pools):
    """--fp8-format with delayed scaling and fp8 all-gather: a run resumed
    from its iteration-2 checkpoint (amax histories restored, weight scales
    recomputed from the loaded weights) repeats the uninterrupted losses."""
    fp8 = ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4",
           "--fp8-param-gather", "--train-iters", "4", "--eval-iters", "0", *DROPOUT]
    ckpt = str(tmp_path / "ckpt")
    first = _pretrain(pools, 2, *fp8, "--save", ckpt, "--save-interval", "2")
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2\n")
    resumed = _pretrain(pools, 2, *fp8, "--load", ckpt)
    losses = [{int(m[1]): m[6] for m in map(LINE.search, proc.stdout.splitlines()) if m} for proc in (first, resumed)]
    assert sorted(losses[0]) == [1, 2, 3, 4] and sorted(losses[1]) == [3, 4]
    assert losses[1] == {k: v for k, v in losses[0].items() if k > 2}


@pytest.mark.slow  # two pretrain() jobs in the worker pool
@pytest.mark.parametrize("precision, tp", [(["--bf16"], 1), (["--fp16", "--initial-loss-scale", "1024"], 2)],
                         ids=["bf16", "fp16-tp2"])
def test_replicated_and_sharded_runs_differ_only_by_sharding(pools, precision, tp):
    """Without --use-torch-fsdp2 the model is replicated through the same wrapper (FSDP2 with a
    shard size of 1) and the same mixed-precision policy (fp16: and the same loss scaler): the
    losses are the sharded run's up to the order of the gradient reductions. Over 2
    data-parallel ranks, once with tensor parallelism as well."""
    runs = {}
    arms = [("replicated", []), ("sharded", ["--use-torch-fsdp2"])]
    if tp == 1:  # and with CPU offload: on CPU tensors the same arithmetic as sharded
        arms.append(("offloaded", ["--use-torch-fsdp2", "--optimizer-cpu-offload"]))
    for name, flags in arms:
        argv = [*MODEL, *[f for f in RUN if f != "--use-torch-fsdp2"], "--tensor-model-parallel-size", str(tp),
                *precision, "--eval-iters", "0", "--train-iters", "3", *flags]
        outcomes = pools(2 * tp).run(pretrain_gpt_job, argv, timeout=400)
        assert all(code == 0 for code, _ in outcomes), outcomes[0][1][-3000:]
        out = "".join(text for _, text in outcomes)
        word = "sharded over" if flags else "replicated on"
        assert f"> data parallel: FSDP2, parameters {word} 2 rank(s)" in out, out[-3000:]
        assert ("optimizer state in CPU memory" in out) == (name == "offloaded")
        runs[name] = {int(m[1]): float(m[6]) for m in map(LINE.search, out.splitlines()) if m}
    assert sorted(runs["replicated"]) == [1, 2, 3]
    assert runs["replicated"] == pytest.approx(runs["sharded"], rel=1e-4)
    if "offloaded" in runs:
        assert runs["offloaded"] == runs["sharded"]


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_token_ids_beyond_the_vocabulary_stop_every_rank_before_training(tmp_path, pools):
    """Data tokenized with a larger vocabulary than --vocab-size: one clear error naming the
    file, on every rank, before the first iteration."""
    import numpy
    import torch

    from megatron_fsdp.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    g = torch.Generator().manual_seed(0)
    for _ in range(64):
        builder.add_item(torch.randint(0, 100, (40,), generator=g))  # ids up to 99
        builder.end_document()
    builder.finalize(prefix + ".idx")
    outcomes = pools(2).run(pretrain_gpt_job, [
        *MODEL, "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "2",
        "--data-path", prefix, "--split", "80,10,10", "--vocab-size", "50", "--eval-iters", "1",
        "--data-cache-path", str(tmp_path / "cache")], True, timeout=400)
    assert not [o for o in outcomes if "iteration        1/" in o[1] + o[2]]
    rank = assert_one_line_error_in_pool(outcomes, "corpus_text_document")
    assert "50" in error_lines(outcomes[rank][2])[0][3]
