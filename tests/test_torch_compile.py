"""Per-layer torch.compile (`--torch-compile`, TorchFullyShardedDataParallelConfig.torch_compile):
each TransformerLayer compiled before it is sharded, composing with FSDP2, TP with sequence
parallelism, activation recomputation, mixed precision and fp8 (tensorwise or rowwise): the
losses of pretrain() with and without it agree (inductor's CPU backend here); delayed fp8
scaling is refused before any work."""

import re

import pytest
import torch

from megatron_fsdp.distributed import TorchFullyShardedDataParallelConfig
from megatron_fsdp.distributed.fsdp_plan import check_torch_compile
from megatron_fsdp.transformer import TransformerConfig
from pretrain_in_pool import pretrain_gpt_job

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--swiglu", "--ffn-hidden-size",
         "128", "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--disable-bias-linear", "--hidden-dropout", "0", "--attention-dropout", "0"]
RUN = ["--use-torch-fsdp2", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
       "--train-iters", "5", "--mock-data", "--vocab-size", "128", "--log-interval", "1", "--eval-iters", "0",
       "--num-workers", "0", "--seed", "5"]
LOSS = re.compile(r"lm loss: ([\d.E+-]+)")


def _job_counting_compiles(argv):
    """The job; how many times torch.compile was asked for (nn.Module.compile calls it) and
    whether the compiled callables then ran (a layer's forward goes through them)."""
    calls, runs, real = [], [], torch.compile

    def counting(*args, **kwargs):
        calls.append(1)
        compiled = real(*args, **kwargs)

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


@pytest.mark.slow  # compiles on 2 cores
# Each option composes with compile in one case or the other: one compile (about 30 s on 2 cores
# with a cold cache) per case, so the options share cases. The first: TP with sequence
# parallelism, recomputation, and fp8 (its linears traced whole, the cast-transpose ops
# included; fp8 weight all-gather); the second: fp16, and the linears' high-precision GEMMs.
@pytest.mark.parametrize("extra", [
    ["--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
     "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
     "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"],
    ["--fp16", "--initial-loss-scale", "1024"],  # a scale that does not overflow: every step counts
], ids=["bf16-tp2-sp-recompute-fp8", "fp16"])
def test_compiled_layers_train_like_eager_ones(pools, extra):
    runs = {}
    for compiled in (False, True):
        argv = [*MODEL, *RUN, *extra, *(["--torch-compile"] if compiled else [])]
        outcomes = pools(2).run(_job_counting_compiles, argv, timeout=400)
        out = "".join(o for _, o, _ in outcomes)  # the last rank logs the losses, rank 0 the setup
        assert all(code == 0 for code, _, _ in outcomes), out[-3000:]
        # The two TransformerLayers, once each, on every rank; their forwards ran compiled.
        assert [n for _, _, n in outcomes] == [(2, True) if compiled else (0, False)] * 2
        assert ("> torch.compile: each of the 2 TransformerLayers" in out) == compiled
        runs[compiled] = [float(x) for x in LOSS.findall(out)]
    eager, compiled = runs[False], runs[True]
    assert len(eager) == len(compiled) == 5
    # bf16/fp16 rounding inside the fused graphs differs from eager's op by op: seen 4e-5 relative.
    assert compiled == pytest.approx(eager, rel=1e-3), (eager, compiled)


def test_delayed_fp8_scaling_is_refused_before_any_work():
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=True, fp8="hybrid",
                               fp8_recipe="delayed")
    with pytest.raises(NotImplementedError, match=r"per-layer compilation \(torch_compile\) with "
                                                  r"fp8_recipe='delayed' is not supported yet"):
        check_torch_compile(config, TorchFullyShardedDataParallelConfig(torch_compile=True))
    check_torch_compile(config, TorchFullyShardedDataParallelConfig())  # eager: fine
    for recipe in ("tensorwise", "rowwise"):
        check_torch_compile(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=True,
                                              fp8="hybrid", fp8_recipe=recipe),
                            TorchFullyShardedDataParallelConfig(torch_compile=True))


def test_the_config_field_is_checked():
    with pytest.raises(ValueError, match="torch_compile must be True or False, got 'yes'"):
        TorchFullyShardedDataParallelConfig(torch_compile="yes")
