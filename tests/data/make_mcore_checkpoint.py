"""Writes tests/data/mcore_torch_dist/: a checkpoint that megatron-core 0.19.2's
dist_checkpointing wrote in its torch_dist format, as Megatron-LM's save_checkpoint
lays it out (the tracker, iter_0000003/ with the model's sharded tensors under their
Megatron-Core keys, the common state holding `args`, `iteration` and
`checkpoint_version`), of a GPT with Megatron-Core's local layer spec (RMSNorm, SwiGLU,
GQA, RoPE, untied embeddings), and expected.pt: token ids and the logits Megatron-Core's
own forward gives for them. It needs megatron-core, which needs Triton to import
(a CUDA build of torch: the CUDA venv of scripts/cuda_build_check.sh) and runs on
the CPU; it was run once:

    pip download --no-deps --python-version 3.12 --only-binary=:all: megatron-core==0.19.2
    unzip megatron_core-0.19.2-*.whl -d /tmp/mcore
    PYTHONPATH=/tmp/mcore .venv-cuda/bin/python tests/data/make_mcore_checkpoint.py

With `--check-load ITER_DIR` it instead loads a torch_dist checkpoint into
Megatron-Core's model (tests/test_mcore_interchange.py: our export) and prints how far
its logits are from those of the fixture's checkpoint loaded alike, and from expected.pt's.
"""

import argparse
import contextlib
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ARGS = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, group_query_attention=True,
            num_query_groups=2, kv_channels=8, swiglu=True, normalization="RMSNorm", norm_epsilon=1e-5,
            disable_bias_linear=True, add_qkv_bias=False, position_embedding_type="rope", rotary_base=10000,
            rotary_percent=1.0, max_position_embeddings=64, untie_embeddings_and_output_weights=True,
            padded_vocab_size=128, vocab_size=100, tensor_model_parallel_size=1, seq_length=16)


def _megatron_core_on_cpu():
    """megatron-core's GPT and dist_checkpointing on the CPU, one process (gloo). Its saver waits on
    the GPU and puts a flag there, its default causal mask is made on the GPU, its attention forks
    the CUDA RNG tracker: none of them is needed here."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MCORE_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    ps.initialize_model_parallel(1, 1)


def build_model(seed: int):
    """Megatron-Core's GPT of ARGS (local spec), initialized from `seed`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    a = ARGS
    config = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], ffn_hidden_size=a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"], num_query_groups=a["num_query_groups"],
        gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm", layernorm_epsilon=a["norm_epsilon"],
        add_bias_linear=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, init_method_std=0.2)
    return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=a["padded_vocab_size"], max_sequence_length=a["max_position_embeddings"],
                    position_embedding_type="rope", rotary_base=a["rotary_base"],
                    share_embeddings_and_output_weights=False).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1), None)[..., :ARGS["vocab_size"]]


def _load(path: str, seed: int):
    """Megatron-Core's model, initialized from `seed`, then loaded from the torch_dist checkpoint
    at `path` (an iter_* directory)."""
    from megatron.core import dist_checkpointing

    model = build_model(seed=seed)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
    model.load_state_dict(state["model"])
    return model


def check_load(path: str) -> None:
    """Megatron-Core loads the torch_dist checkpoint at `path` (our export) into one model and the
    fixture's own checkpoint into another, each initialized otherwise first; prints the largest
    difference of the first's logits from the second's, both computed here (bitwise the same
    weights give exactly 0.0), and from expected.pt's (written on another machine, whose CPU kernels may
    round differently in the last bits)."""
    _megatron_core_on_cpu()
    expected = torch.load(os.path.join(HERE, "mcore_torch_dist", "expected.pt"))
    ours = _logits(_load(path, seed=99), expected["ids"])
    fixture = _logits(_load(os.path.join(HERE, "mcore_torch_dist", "iter_0000003"), seed=98), expected["ids"])
    print("max logits difference:", float((ours - fixture).abs().max()))
    print("max logits difference from expected.pt:", float((ours - expected["logits"]).abs().max()))
    dist.destroy_process_group()


def main() -> None:
    from megatron.core import dist_checkpointing

    _megatron_core_on_cpu()
    model = build_model(seed=3)
    with torch.no_grad():  # non-trivial norm weights: a swapped norm would show
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_norm" in name:
                p.normal_(1.0, 0.3)
    a = ARGS
    ids = torch.randint(0, a["vocab_size"], (2, a["seq_length"]), generator=torch.Generator().manual_seed(1))
    logits = _logits(model, ids)
    out = os.path.join(HERE, "mcore_torch_dist")
    shutil.rmtree(out, ignore_errors=True)
    path = os.path.join(out, "iter_0000003")
    os.makedirs(path)
    state = {"model": model.sharded_state_dict(), "args": argparse.Namespace(**a), "checkpoint_version": 3.0,
             "iteration": 3}
    dist_checkpointing.save(state, path)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    torch.save({"ids": ids, "logits": logits.clone()}, os.path.join(out, "expected.pt"))
    print("wrote", out, sorted(os.listdir(path)))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check-load"]:
        check_load(sys.argv[2])
    else:
        main()
