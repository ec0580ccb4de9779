"""Fused bias-activation on and off: one MLP (fc1, activation, fc2) forward and
backward, as megatron_fsdp.transformer.MLP runs it.

    python benchmarks/bench_activations.py [--device cpu|cuda] [--repeats 20] [--preset 1b|8b|tiny]

Arms, per activation (SwiGLU without bias as in Llama, and bias-GELU):
  unfused       bias_activation_fusion=False: the activation in the parameters' dtype,
                one kernel per op (what a run with --no-bias-swiglu-fusion does)
  fused_eager   bias_activation_fusion=True on the eager path: Megatron's fp32 arithmetic
                in separate ops (what the fusion cost before the kernels, and on the CPU)
  fused         bias_activation_fusion=True: one Triton kernel each way (CUDA only)

The arm times are the MLP's forward + backward (with the GEMMs, as a layer pays
them), and the activation alone (forward + backward of the activation function
on fc1's output). Arms alternate in rounds; each arm's best round is reported,
in ms. One JSON line per case: "ours_ms" is the fused arm (the eager one on the
CPU), "torch_ms" the unfused one, "torch_over_ours" their ratio (> 1: the
fusion pays).
Presets: 1b (hidden 2048, ffn 8192, 8192 tokens: the Llama-1B-like shape of
issue 19), 8b (hidden 4096, ffn 14336, 4096 tokens), tiny (the CPU's).

RoPE too: the rotation of a layer's queries (seq 2048 x micro-batch 4 x 16 heads x 128 at 1b,
2048 x 2 x 32 x 128 at 8b), forward + backward, with Megatron's unfused and fused
(apply_rope_fusion) numerics: the eager ops ("torch_ms") against the Triton kernel ("ours_ms";
CUDA only, else the eager path again). And bias-dropout-add (dropout 0.1, no bias, a layer's
[seq, micro-batch, hidden] output): unfused ops in bf16 ("torch_ms"), the eager fp32 fusion and
the Triton kernel ("ours_ms"), forward + backward. And the language model's cross entropy on bf16
logits [seq, micro-batch, vocabulary] (2048 x 4 x 32768 at 1b, 2048 x 2 x 128256 at 8b: Llama 3's
vocabulary), forward + backward: Megatron's default, the unfused loss on an fp32 copy of the
logits ("torch_ms"), against cross_entropy_loss_fusion's Triton kernels ("ours_ms"; CUDA only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import best_of_rounds
from megatron_fsdp import parallel_state
from megatron_fsdp.fusions import fused_cross_entropy
from megatron_fsdp.models.common.embeddings import rotary_pos_embedding
from megatron_fsdp.transformer import TransformerConfig, fused_activations, transformer_layer
from megatron_fsdp.tensor_parallel import vocab_parallel_cross_entropy
from megatron_fsdp.transformer.mlp import MLP

PRESETS = {"1b": (2048, 8192, 8192), "8b": (4096, 14336, 4096), "tiny": (64, 256, 256)}  # hidden, ffn, tokens
BDA_SHAPES = {"1b": (2048, 4, 2048), "8b": (2048, 2, 4096), "tiny": (64, 2, 64)}  # s, b, hidden
CE_SHAPES = {"1b": (2048, 4, 32768), "8b": (2048, 2, 128256), "tiny": (64, 2, 512)}  # s, b, vocabulary
ROPE_SHAPES = {"1b": (2048, 4, 16, 128), "8b": (2048, 2, 32, 128), "tiny": (64, 2, 4, 16)}  # s, b, heads, head_dim


@contextlib.contextmanager
def _eager_path(on: bool, module=fused_activations):
    """With `on`, `module`'s fused function (bias_activation, apply_rotary_pos_emb, bias_dropout_add)
    takes its eager path even for CUDA tensors, forward and backward."""
    if not on:
        yield
        return
    saved = module._kernels_for
    module._kernels_for = lambda t: None
    try:
        yield
    finally:
        module._kernels_for = saved


def _mlp(kind: str, fusion: bool, hidden: int, ffn: int, device, dtype) -> MLP:
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=8, ffn_hidden_size=ffn,
                               gated_linear_unit=kind == "swiglu",
                               activation_func=F.silu if kind == "swiglu" else F.gelu,
                               add_bias_linear=kind == "gelu", bias_activation_fusion=fusion,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16, hidden_dropout=0.0)
    return MLP(config).to(device)


def bench(kind: str, hidden: int, ffn: int, tokens: int, repeats: int, device, dtype) -> dict:
    x = torch.randn(tokens, 1, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, 1, hidden, device=device, dtype=dtype)
    mlps = {"unfused": _mlp(kind, False, hidden, ffn, device, dtype), "fused": _mlp(kind, True, hidden, ffn, device,
                                                                                  dtype)}
    def mlp_step(mlp, eager_path=False):
        def step():
            with _eager_path(eager_path):
                out, _ = mlp(x)
                out.backward(grad)
        return step

    fc1_out, fc1_bias = mlps["fused"].linear_fc1(x)
    fc1_out = fc1_out.detach().requires_grad_()
    width = fc1_out.shape[-1] // (2 if kind == "swiglu" else 1)
    act_grad = torch.randn(tokens, 1, width, device=device, dtype=dtype)

    def act_step(how):
        def step():
            with _eager_path(how == "fused_eager"):  # forward and backward alike
                if how == "unfused":
                    y = fc1_out + fc1_bias if fc1_bias is not None else fc1_out
                    if kind == "swiglu":
                        gate, up = y.chunk(2, dim=-1)
                        out = F.silu(gate) * up
                    else:
                        out = F.gelu(y)
                else:
                    out = fused_activations.bias_activation(fc1_out, fc1_bias, kind)
                out.backward(act_grad)
        return step

    arms = {"unfused": mlp_step(mlps["unfused"]), "fused_eager": mlp_step(mlps["fused"], eager_path=True),
            "act/unfused": act_step("unfused"), "act/fused_eager": act_step("fused_eager")}
    if device.type == "cuda" and fused_activations._kernels_for(fc1_out) is not None:
        arms["fused"] = mlp_step(mlps["fused"])
        arms["act/fused"] = act_step("fused")
    ms = {name: round(t, 3) for name, t in best_of_rounds(arms, repeats, device).items()}
    ours = "fused" if "fused" in ms else "fused_eager"
    return {"case": f"mlp/{kind}/{hidden}x{ffn}x{tokens}/{str(dtype).split('.')[-1]}",
            "ours_ms": ms[ours], "torch_ms": ms["unfused"], "torch_over_ours": round(ms["unfused"] / ms[ours], 3),
            "fused_eager_ms": ms["fused_eager"], "activation_ms": ms[f"act/{ours}"],
            "activation_unfused_ms": ms["act/unfused"], "activation_fused_eager_ms": ms["act/fused_eager"],
            "arm": ours, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__}


def _shape_dtype(shape, dtype) -> str:
    return f"{'x'.join(map(str, shape))}/{str(dtype).split('.')[-1]}"


def _timed_row(case: str, arms: dict, repeats: int, device, *, baseline: str, kernel: str, fallback: str,
               **extra_ms) -> dict:
    """`arms` timed in alternating rounds, as one JSON row: "ours_ms" the `kernel` arm (CUDA) or,
    where it did not run, the `fallback` one; "torch_ms" the `baseline` arm; `extra_ms` names
    further fields after the arms they report."""
    ms = {name: round(t, 3) for name, t in best_of_rounds(arms, repeats, device).items()}
    ours = kernel if kernel in ms else fallback
    return {"case": case, "ours_ms": ms[ours], "torch_ms": ms[baseline],
            "torch_over_ours": round(ms[baseline] / ms[ours], 3),
            **{field: ms[arm] for field, arm in extra_ms.items()}, "arm": ours,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}


def bench_rope(shape, fused: bool, repeats: int, device, dtype) -> dict:
    q = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(*shape, device=device, dtype=dtype)
    freqs = rotary_pos_embedding.RotaryEmbedding(shape[-1], rotary_percent=1.0)(shape[0]).to(device)
    config = SimpleNamespace(apply_rope_fusion=fused)

    def step(kernel: bool):
        def run():
            with _eager_path(not kernel, rotary_pos_embedding):
                q.grad = None  # a fresh gradient each step, not an accumulation
                rotary_pos_embedding.apply_rotary_pos_emb(q, freqs, config).backward(grad)
        return run

    arms = {"eager": step(False)}
    if rotary_pos_embedding._kernels_for(q) is not None:
        arms["kernel"] = step(True)
    return _timed_row(f"rope/{'fused' if fused else 'unfused'}/{_shape_dtype(shape, dtype)}", arms, repeats, device,
                      baseline="eager", kernel="kernel", fallback="eager")


def bench_bias_dropout_add(shape, repeats: int, device, dtype) -> dict:
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    residual = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(*shape, device=device, dtype=dtype)

    def step(fused: bool, kernel: bool):
        def run():
            with _eager_path(not kernel, transformer_layer):
                x.grad = residual.grad = None
                transformer_layer.bias_dropout_add(x, None, residual, 0.1, True, fused).backward(grad)
        return run

    arms = {"unfused": step(False, False), "fused_eager": step(True, False)}
    if transformer_layer._kernels_for(x) is not None:
        arms["fused"] = step(True, True)
    return _timed_row(f"bias_dropout_add/{_shape_dtype(shape, dtype)}", arms, repeats, device, baseline="unfused",
                      kernel="fused", fallback="fused_eager", fused_eager_ms="fused_eager")


def bench_cross_entropy(shape, repeats: int, device, dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(*shape, generator=g) * 2).to(device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, shape[-1], shape[:-1], generator=g).to(device)
    grad = torch.rand(shape[:-1], generator=g).to(device)

    def step(fused: bool):
        def run():
            logits.grad = None
            if fused:
                loss = fused_cross_entropy.fused_vocab_parallel_cross_entropy(logits, target)
            else:  # Megatron's default (GPTModel.compute_language_model_loss without the fusion)
                loss = vocab_parallel_cross_entropy(logits.float(), target)
            loss.backward(grad)
        return run

    arms = {"unfused": step(False)}
    if fused_cross_entropy._kernels_for(logits) is not None:
        arms["fused"] = step(True)
    return _timed_row(f"cross_entropy/{_shape_dtype(shape, dtype)}", arms, repeats, device, baseline="unfused",
                      kernel="fused", fallback="unfused")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    presets = [args.preset] if args.preset else (["1b", "8b"] if device.type == "cuda" else ["tiny"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # The MLP's parallel linears ask parallel_state for their TP group: one process, TP=1.
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
            for preset in presets:
                hidden, ffn, tokens = PRESETS[preset]
                for kind in ("swiglu", "gelu"):
                    print(json.dumps(bench(kind, hidden, ffn, tokens, args.repeats, device, dtype)), flush=True)
                for fused in (False, True):
                    print(json.dumps(bench_rope(ROPE_SHAPES[preset], fused, args.repeats, device, dtype)), flush=True)
                print(json.dumps(bench_bias_dropout_add(BDA_SHAPES[preset], args.repeats, device, dtype)), flush=True)
                print(json.dumps(bench_cross_entropy(CE_SHAPES[preset], args.repeats, device, dtype)), flush=True)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
