"""Per-layer torch.compile (`--torch-compile`, TorchFullyShardedDataParallelConfig.torch_compile):
each TransformerLayer compiled before it is sharded, composing with FSDP2, TP with sequence
parallelism, activation recomputation, mixed precision and fp8 (tensorwise or rowwise): the
losses of pretrain() with and without it are the same (traced under aot_eager: bit for bit), delayed
fp8 scaling's histories included; single fp8 linears compile without a graph break (inductor's CPU
backend for tensorwise scaling)."""

import re

import pytest
import torch

from megatron_fsdp.distributed import TorchFullyShardedDataParallelConfig
from megatron_fsdp.fp8 import Fp8LinearState, Fp8Recipe, fp8_linear, materialize_fp8_state, refresh_fp8_scales
from megatron_fsdp.transformer import TransformerConfig
from pretrain_in_pool import pretrain_gpt_job

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--swiglu", "--ffn-hidden-size",
         "128", "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0"]
RUN = ["--use-torch-fsdp2", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
       "--train-iters", "5", "--mock-data", "--vocab-size", "128", "--log-interval", "1", "--eval-iters", "0",
       "--num-workers", "0", "--seed", "5"]
LOSS = re.compile(r"lm loss: ([\d.E+-]+)")


def _job_counting_compiles(argv, backend="inductor"):
    """The job; how many times torch.compile was asked for (nn.Module.compile calls it) and
    whether the compiled callables then ran (a layer's forward goes through them). `backend`:
    what those compiles use (--torch-compile's is inductor, torch.compile's default)."""
    calls, runs, real = [], [], torch.compile

    def counting(*args, **kwargs):
        calls.append(1)
        assert "backend" not in kwargs, kwargs  # the job asks for torch.compile's default
        compiled = real(*args, backend=backend, **kwargs)

        def run(*a, **k):
            runs.append(1)
            return compiled(*a, **k)
        return run

    torch.compile = counting
    try:
        code, out = pretrain_gpt_job(argv)
    finally:
        torch.compile = real
    return code, out, (len(calls), len(runs) > 0)


def train_eager_and_compiled(pools, nproc: int, argv: list) -> dict:
    """`argv` trained eagerly and with --torch-compile (its compiles under aot_eager) on `nproc`
    ranks of the pool: each job exits 0, and with --torch-compile the two TransformerLayers were
    compiled once each on every rank and ran compiled. {compiled: (the losses, the jobs' output)}."""
    runs = {}
    for compiled in (False, True):
        outcomes = pools(nproc).run(_job_counting_compiles, [*argv, *(["--torch-compile"] if compiled else [])],
                                    "aot_eager", timeout=400)
        out = "".join(o for _, o, _ in outcomes)  # the last rank logs the losses, rank 0 the setup
        assert all(code == 0 for code, _, _ in outcomes), out[-3000:]
        assert [n for _, _, n in outcomes] == [(2, True) if compiled else (0, False)] * nproc
        runs[compiled] = ([float(x) for x in LOSS.findall(out)], out)
    return runs


@pytest.mark.slow  # compiles on 2 cores
# Each option composes with compile in one case or the other, so the options share cases. The
# first: TP with sequence parallelism, recomputation, and fp8 with delayed scaling (Megatron's
# default recipe: its linears traced whole, the cast-transpose ops included, recompiled once when
# the histories calibrate; fp8 weight all-gather); the second: fp16, and the linears'
# high-precision GEMMs. Tensorwise fp8 compiles in the single-process test below.
# aot_eager: dynamo and AOT autograd trace what inductor would (FSDP2's hooks around each compiled
# layer, functionalization: where the composition bugs lived) and the traced ops then run as eager
# runs them, so the losses equal eager's bit for bit. Inductor's code generation (about 20 s a case
# cold on 2 cores) adds nothing to these compositions that tracing does not: it runs once, on the
# tensorwise fp8 linear below, whose custom ops it lowers.
@pytest.mark.parametrize("extra", [
    ["--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
     "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
     "--fp8-format", "hybrid", "--fp8-param-gather"],  # --fp8-recipe's default: delayed
    ["--fp16", "--initial-loss-scale", "1024"],  # a scale that does not overflow: every step counts
], ids=["bf16-tp2-sp-recompute-fp8", "fp16"])
def test_compiled_layers_train_like_eager_ones(pools, extra):
    runs = train_eager_and_compiled(pools, 2, [*MODEL, *RUN, *extra])
    for compiled, (_, out) in runs.items():
        assert ("> torch.compile: each of the 2 TransformerLayers" in out) == compiled
    losses = {compiled: losses for compiled, (losses, _) in runs.items()}
    assert len(losses[False]) == 5 and losses[True] == losses[False], losses


class _Fp8Layer(torch.nn.Module):
    def __init__(self, recipe):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 32, generator=torch.Generator().manual_seed(1)))
        self.fp8_state = Fp8LinearState(recipe)

    def forward(self, x):
        return fp8_linear(torch.relu(x), self.weight, self.fp8_state)


@pytest.mark.slow  # compiles (delayed: twice, the second time once the histories are calibrated)
# Tensorwise scaling under inductor (our fp8 ops in its generated code); delayed scaling, whose
# recompile once the histories calibrate is dynamo's doing, under aot_eager (the same tracing).
@pytest.mark.parametrize("recipe_name, backend", [("delayed", "aot_eager"), ("tensorwise", "inductor")])
def test_fp8_linears_compile_whole_and_train_like_eager(recipe_name, backend):
    """fullgraph=True: no graph break, so under delayed scaling the histories are recorded from
    inside the compiled graph (input amax) and through the sink's gradient (output gradient
    amax); outputs, gradients, histories and scales equal the eager run's step by step."""
    recipe = Fp8Recipe.from_config(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                                     fp8="hybrid", fp8_recipe=recipe_name, fp8_amax_history_len=4))
    results = {}
    for compiled in (False, True):
        layer = _Fp8Layer(recipe)
        materialize_fp8_state(layer, torch.device("cpu"))
        run = torch.compile(layer, fullgraph=True, backend=backend) if compiled else layer
        steps = []
        for step in range(3):
            x = (torch.randn(48, 32, generator=torch.Generator().manual_seed(step)) * (step + 1)).requires_grad_()
            y = run(x)
            (y * (step + 2)).square().sum().backward()
            pending = [float(h.pending) for _, h in layer.fp8_state.histories()]
            refresh_fp8_scales(layer)
            steps.append((y.detach(), x.grad, layer.weight.grad.clone(), pending,
                          [(h.amax_history.clone(), h.scale.clone()) for _, h in layer.fp8_state.histories()]))
            layer.weight.grad = None
        results[compiled] = steps
    for step, (eager, compiled) in enumerate(zip(results[False], results[True])):
        torch.testing.assert_close(compiled[:3], eager[:3], msg=f"step {step}")
        # Recorded: max |relu(x)| and max |d loss / dy| of the step, the same in both.
        assert compiled[3] == eager[3], (step, eager[3], compiled[3])
        assert (min(eager[3]) > 0) if recipe.delayed else eager[3] == []
        torch.testing.assert_close(compiled[4], eager[4])
    assert [h.calibrated for _, h in layer.fp8_state.histories()] == ([True, True] if recipe.delayed else [])


def test_delayed_fp8_state_must_be_on_a_device_before_a_compiled_first_run(monkeypatch):
    """A compiled first run cannot create the histories: a clear error names the call that does
    (the FSDP plan makes it: test above and the pool case)."""
    recipe = Fp8Recipe.from_config(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                                                     fp8="hybrid", fp8_recipe="delayed"))
    state = Fp8LinearState(recipe)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match=r"call megatron_fsdp.fp8.materialize_fp8_state\(model, device\) "
                                           "before compiling"):
        state.materialize(torch.device("cpu"))
    monkeypatch.undo()
    state.materialize(torch.device("cpu"))
    assert state.grad_output_sink.requires_grad and state.grad_output_sink.is_leaf
    state.materialize(torch.device("cpu"))  # once only


def test_the_config_field_is_checked():
    with pytest.raises(ValueError, match="torch_compile must be True or False, got 'yes'"):
        TorchFullyShardedDataParallelConfig(torch_compile="yes")
