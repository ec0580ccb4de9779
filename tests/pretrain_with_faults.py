"""examples/pretrain_gpt.py with one injected fault, for tests/test_training_faults.py.

    torchrun ... tests/pretrain_with_faults.py <pretrain_gpt flags>
    MEGATRON_FSDP_FAULT=nan|sigterm|stall  FAULT_RANK=r  FAULT_ITERATION=k  [FAULT_SECONDS=s]

nan: rank r's embedding output becomes NaN in iteration k. sigterm: rank r
sends itself SIGTERM after iteration k's step. stall: rank r sleeps s seconds
before iteration k (a stuck rank). The script itself is untouched.
"""

import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import pretrain_gpt  # noqa: E402

FAULT = os.environ["MEGATRON_FSDP_FAULT"]
RANK = int(os.environ["FAULT_RANK"])
ITERATION = int(os.environ["FAULT_ITERATION"])
current = {"iteration": 0}
here = int(os.environ["RANK"]) == RANK

original_train_step = pretrain_gpt.train_step
original_build_model = pretrain_gpt.build_model


def train_step(args, model, optimizer, dataset, iteration, *rest):
    current["iteration"] = iteration
    if FAULT == "stall" and here and iteration == ITERATION:
        time.sleep(float(os.environ["FAULT_SECONDS"]))
    result = original_train_step(args, model, optimizer, dataset, iteration, *rest)
    if FAULT == "sigterm" and here and iteration == ITERATION:
        os.kill(os.getpid(), signal.SIGTERM)
    return result


def build_model(args):
    model = original_build_model(args)
    inner = getattr(model, "module", model)

    def poison(module, inputs, output):
        if here and current["iteration"] == ITERATION:
            return output * float("nan")
        return output

    if FAULT == "nan":
        inner.embedding.register_forward_hook(poison)
    return model


pretrain_gpt.train_step = train_step
pretrain_gpt.build_model = build_model
if __name__ == "__main__":
    pretrain_gpt.main()
