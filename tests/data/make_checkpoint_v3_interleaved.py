"""Writes tests/data/checkpoint_v3_interleaved/: a checkpoint of format
version 3, whose gated MLPs keep fc1 with its gate and up rows interleaved
(gate_0, up_0, gate_1, up_1, ...), and expected.pt, what a load must restore
in the [gate; up] layout that later versions use (Megatron-Core's). It was
run once, at commit 536d382 (the last version with the interleaved layout),
so that tests/test_checkpoint_formats.py proves that later versions still
load it, converted; rerunning it with a later version writes that version's
format instead.

The model: a 2-layer SwiGLU GPT with fc1 biases, bf16 parameters with fp32
main params, Adam state after two steps (TP=1, one process: a format-3
checkpoint's fc1 is the same at every TP size).

    python tests/data/make_checkpoint_v3_interleaved.py
"""

import os
import shutil
import sys
import warnings

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from helpers import make_config, setup_parallel  # noqa: E402
from megatron_fsdp.models.gpt import GPTModel  # noqa: E402
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron_fsdp.training.checkpointing import save_checkpoint  # noqa: E402

VOCAB, SEQ = 64, 8


def build():
    """The fixture's model and optimizer (the test builds the same at any TP size)."""
    cfg = make_config(hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, gated_linear_unit=True,
                      activation_func=F.silu, add_bias_linear=True, bf16=True, params_dtype=torch.bfloat16)
    model = GPTModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True, params_dtype=torch.bfloat16), model)
    return model, optimizer


def to_gate_up(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An fc1 tensor of this fixture in the [gate; up] layout (rows 0::2 are the gate's)."""
    if ".mlp.linear_fc1." in name:
        return torch.cat([tensor[0::2], tensor[1::2]])
    return tensor


def main() -> None:
    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    out = os.path.join(HERE, "checkpoint_v3_interleaved")
    shutil.rmtree(out, ignore_errors=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    setup_parallel(1, seed=5)
    model, optimizer = build()
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        model(ids[:, :-1], None, None, labels=ids[:, 1:]).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(2, model, optimizer, None, out, true_vocab_size=VOCAB)
    inner = optimizer.optimizer
    names = {id(p): n for n, p in optimizer.main_params_module(model).named_parameters()}
    expected = {
        "params": {n: to_gate_up(n, p.detach().clone()) for n, p in model.named_parameters()},
        "main_params": {n: to_gate_up(n, t.clone()) for n, t in optimizer.main_params_state_dict(model).items()},
        "exp_avg": {names[id(p)]: to_gate_up(names[id(p)], inner.state[p]["exp_avg"].clone())
                    for group in inner.param_groups for p in group["params"]},
        "exp_avg_sq": {names[id(p)]: to_gate_up(names[id(p)], inner.state[p]["exp_avg_sq"].clone())
                       for group in inner.param_groups for p in group["params"]},
    }
    torch.save(expected, os.path.join(out, "expected.pt"))
    torch.distributed.destroy_process_group()
    print("wrote", out, sorted(os.listdir(os.path.join(out, "iter_0000002"))))


if __name__ == "__main__":
    main()
