"""examples/pretrain_gpt.py with one injected fault, for tests/test_training_faults.py.

    torchrun ... tests/pretrain_with_faults.py <pretrain_gpt flags>
    MEGATRON_FSDP_FAULT=nan|sigterm|stall  FAULT_RANK=r  FAULT_ITERATION=k  [FAULT_SECONDS=s]

nan: rank r's embedding output becomes NaN in iteration k. sigterm: rank r
sends itself SIGTERM after iteration k's step. stall: rank r sleeps s seconds
before iteration k (a stuck rank). The script and the package are untouched:
the fault wraps megatron_fsdp.training.training.train_step and the example's
model_provider.
"""

import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import pretrain_gpt  # noqa: E402

from megatron_fsdp.enums import ModelType  # noqa: E402
from megatron_fsdp.training import training  # noqa: E402

FAULT = os.environ["MEGATRON_FSDP_FAULT"]
RANK = int(os.environ["FAULT_RANK"])
ITERATION = int(os.environ["FAULT_ITERATION"])
current = {"iteration": 0}
here = int(os.environ["RANK"]) == RANK

original_train_step = training.train_step


def train_step(*args, iteration=None, **kwargs):
    current["iteration"] = iteration + 1  # train_step's argument counts the iterations already done
    if FAULT == "stall" and here and current["iteration"] == ITERATION:
        time.sleep(float(os.environ["FAULT_SECONDS"]))
    result = original_train_step(*args, iteration=iteration, **kwargs)
    if FAULT == "sigterm" and here and current["iteration"] == ITERATION:
        os.kill(os.getpid(), signal.SIGTERM)
    return result


def model_provider(*args, **kwargs):
    model = pretrain_gpt.model_provider(*args, **kwargs)

    def poison(module, inputs, output):
        if here and current["iteration"] == ITERATION:
            return output * float("nan")
        return output

    if FAULT == "nan":
        model.embedding.register_forward_hook(poison)
    return model


training.train_step = train_step
if __name__ == "__main__":
    pretrain_gpt.pretrain(pretrain_gpt.train_valid_test_datasets_provider, model_provider,
                          ModelType.encoder_or_decoder, pretrain_gpt.forward_step)
