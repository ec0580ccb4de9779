"""What pretrain() reads back from its tensors in a training step: the places where a
GPU run waits for the device. Megatron-LM reads the gradient norm (clipping), the
NaN/inf check and, in fp16, the loss scaler's found-inf each step, and the losses and
the loss scale only where it logs them; so must we. Counted on the CPU (gloo), where
every host read of a tensor is seen by a TorchFunctionMode and named by the function
of ours that made it."""

import traceback
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pretrain_in_pool import pretrain_gpt_job

MODEL = ["--num-layers", "2", "--hidden-size", "48", "--num-attention-heads", "4", "--swiglu", "--ffn-hidden-size",
         "96", "--seq-length", "16", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--disable-bias-linear"]
RUN = ["--use-torch-fsdp2", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--train-iters",
       "8", "--mock-data", "--vocab-size", "64", "--log-interval", "4", "--eval-iters", "0", "--num-workers", "0"]
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
          torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy}


def _site() -> str:
    """The innermost frame of megatron_fsdp or the example that asked (torch's own frames skipped)."""
    for frame in reversed(traceback.extract_stack()[:-2]):  # not _site, not __torch_function__
        if "/megatron_fsdp/" in frame.filename or "/examples/" in frame.filename:
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"
    return "torch"


class _HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.window: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.window[_site()] += 1
        return func(*args, **(kwargs or {}))


def _case_reads_per_step(argv):
    from megatron_fsdp.training import training_log

    reads, steps = _HostReads(), []
    logged = training_log.TrainingLogger.training_log

    def recording(self, loss_dict, learning_rate, iteration, *args, **kwargs):
        steps.append((iteration, dict(reads.window)))  # this iteration's step, before its logging
        logged(self, loss_dict, learning_rate, iteration, *args, **kwargs)
        reads.window.clear()

    training_log.TrainingLogger.training_log = recording
    try:
        with reads:
            code, out = pretrain_gpt_job(argv)
    finally:
        training_log.TrainingLogger.training_log = logged
    assert code == 0, out[-2000:]
    return steps


# Per step: the gradient norm, the NaN/inf verdict (one read of one all-reduce), fp16's found-inf
# (with a loss scale that does not overflow: a skipped step computes no gradient norm).
# fp8 (delayed scaling, fp8 all-gather) adds none: scales and amaxes stay on the device.
FLAGS = {"bf16": ["--bf16"], "fp16": ["--fp16", "--initial-loss-scale", "1024"],
         "bf16-fp8": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-param-gather"]}
EXPECTED = {
    "bf16": {"clip_grads.py:get_grad_norm_fp32": 1, "utils.py:non_finite_ranks": 1},
    "bf16-fp8": {"clip_grads.py:get_grad_norm_fp32": 1, "utils.py:non_finite_ranks": 1},
    "fp16": {"clip_grads.py:get_grad_norm_fp32": 1, "utils.py:non_finite_ranks": 1,
             "optimizer.py:_unscale_main_grads_and_check_for_nan": 1},
}


@pytest.mark.slow  # pretrain() jobs in the worker pool
@pytest.mark.parametrize("precision", sorted(EXPECTED))
def test_a_step_reads_back_only_what_megatron_reads(pools, precision):
    steps = pools(2).run(_case_reads_per_step, [*MODEL, *RUN, *FLAGS[precision]], timeout=300)[0]
    assert [i for i, _ in steps] == list(range(1, 9))
    # Iteration 1 builds optimizer state and logs memory; from then on every step alike,
    # logging iterations (4, 8) included: their reads come after the step.
    per_step = [sites for i, sites in steps if i > 1]
    assert all(sites == per_step[0] for sites in per_step), per_step
    assert per_step[0] == EXPECTED[precision], per_step[0]
