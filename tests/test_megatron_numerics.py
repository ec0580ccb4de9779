"""Numerics that must be Megatron-Core 0.19's, each against a small formula
written here the way Megatron computes it (no megatron import)."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import full_grads, full_params, make_config, setup_parallel
from megatron_fsdp import parallel_state
from megatron_fsdp.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.models.gpt.megatron_layout import from_megatron_layout, to_megatron_layout
from megatron_fsdp.transformer import DotProductAttention, TransformerConfig
from megatron_fsdp.transformer.enums import AttnMaskType
from megatron_fsdp.transformer.transformer_layer import bias_dropout_add

# ------------------------------------------------------------------ RoPE under FSDP bf16

ROPE_SEQ = 2048


def _megatron_rope(t, dim, fused):
    """Megatron's RoPE of t [s, b, heads, hn]: fp32 angles; unfused rounds cos/sin
    to t's dtype, Transformer Engine's fused kernel rotates in fp32."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(t.size(0), dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    x = t.float() if fused else t
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(t.dtype)


def _case_rope_fsdp_bf16(fused):
    setup_parallel(1)
    cfg = make_config(num_layers=1, bf16=True, apply_rope_fusion=fused)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=ROPE_SEQ, position_embedding_type="rope")
    attention = model.decoder.layers[0].self_attention
    captured = {}
    split = attention.get_query_key_value_tensors

    def capture_split(hidden_states):
        query, key, value = split(hidden_states)
        captured["q"], captured["k"] = query.detach(), key.detach()
        return query, key, value

    attention.get_query_key_value_tensors = capture_split
    attention.core_attention.register_forward_pre_hook(
        lambda module, args: captured.update(q_rot=args[0].detach(), k_rot=args[1].detach()))
    wrapped = TorchFullyShardedDataParallel(cfg, TorchFullyShardedDataParallelConfig(), model)
    ids = torch.randint(0, 64, (1, ROPE_SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wrapped(ids, None, None)
    assert captured["q"].dtype == torch.bfloat16
    errors = {}
    for name in ("q", "k"):
        expected = _megatron_rope(captured[name], cfg.kv_channels, fused)
        err = (captured[name + "_rot"].float() - expected.float()).abs().amax(dim=(1, 2, 3))
        first, last = err[:64].max().item(), err[-64:].max().item()
        assert last <= first, f"{name}: rotation error {last:.3g} at the last positions, {first:.3g} at the first"
        errors[name] = (first, last)
    return errors


@pytest.mark.parametrize("fused", [False, True])
def test_rope_angles_stay_fp32_under_fsdp_bf16(pools, fused):
    pools(2).run(_case_rope_fsdp_bf16, fused)


# ------------------------------------------------------------------ fully masked attention rows


def _megatron_local_attention(q, k, v, mask, scale):
    """Megatron's local DotProductAttention + FusedScaleMaskSoftmax (torch path,
    softmax in fp32): baddbmm with alpha=scale in the input dtype, masked
    scores filled with -10000, probabilities cast back."""
    s, b, n, hn = q.shape
    q2 = q.reshape(s, b * n, hn).transpose(0, 1)
    k2 = k.reshape(s, b * n, hn).transpose(0, 1)
    scores = torch.baddbmm(torch.empty(b * n, s, s, dtype=q.dtype), q2, k2.transpose(1, 2), beta=0.0, alpha=scale)
    scores = scores.view(b, n, s, s).float().masked_fill(mask, -10000.0)
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b * n, s, s)
    context = torch.bmm(probs, v.reshape(s, b * n, hn).transpose(0, 1))
    return context.view(b, n, s, hn).permute(2, 0, 1, 3).reshape(s, b, n * hn)


def _case_fully_masked_rows(dtype):
    setup_parallel(1)
    cfg = make_config()
    attention = DotProductAttention(cfg, attn_mask_type=AttnMaskType.causal)
    s, b, n, hn = 8, 2, 4, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, n, hn, generator=g).to(dtype).requires_grad_(True) for _ in range(3))
    # Megatron's GPT mask (causal) plus padding: sample 1's first 3 tokens are padding,
    # masked as keys and as queries, so queries 0-2 of sample 1 see no key at all.
    mask = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s).clone()
    mask[1, :, :, :3] = True
    out = attention(q, k, v, mask)
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = _megatron_local_attention(*ref_inputs, mask, 1.0 / math.sqrt(hn))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    # The fully masked rows are the mean of all values, as in Megatron, not zeros.
    torch.testing.assert_close(out[:3, 1], v[:, 1].float().mean(0).reshape(1, -1).expand(3, -1).to(dtype), **tol)
    torch.testing.assert_close(out, ref, **tol)
    if dtype == torch.float32:
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
        ref.backward(grad)
        for name, ours, theirs in zip("qkv", (q, k, v), ref_inputs):
            torch.testing.assert_close(ours.grad, theirs.grad, **tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_attention_row_is_uniform_as_in_megatron(pools, dtype):
    pools(2).run(_case_fully_masked_rows, dtype)


# ------------------------------------------------------------------ bias_activation_fusion


def _megatron_fused_activation(y, bias, kind):
    """Megatron's compiled bias-GELU / bias-GeGLU / bias-SwiGLU: fp32 inside, one
    rounding; GELU is the tanh form with Megatron's constant. Gated inputs are
    [gate; up] halves, Megatron's `torch.chunk(y, 2, -1)`."""
    x = y.float() + bias.float() if bias is not None else y.float()

    def gelu(t):
        return t * 0.5 * (1.0 + torch.tanh(0.79788456 * t * (1 + 0.044715 * t * t)))

    if kind == "gelu":
        return gelu(x).to(y.dtype)
    gate, up = torch.chunk(x, 2, -1)
    return ((gelu(gate) if kind == "geglu" else F.silu(gate)) * up).to(y.dtype)


FUSION_CASES = {
    "gelu": dict(activation_func=F.gelu),
    "geglu": dict(activation_func=F.gelu, gated_linear_unit=True),
    "swiglu": dict(activation_func=F.silu, gated_linear_unit=True),
}


def _case_bias_activation_fusion(kind, dtype):
    setup_parallel(1)
    cfg = make_config(bias_activation_fusion=True, params_dtype=dtype, **FUSION_CASES[kind])
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=8)
    mlp = model.decoder.layers[0].mlp
    with torch.no_grad():
        mlp.linear_fc1.bias.normal_(0, 0.5)  # a nonzero bias, so the fused bias add is exercised
        mlp.linear_fc1.weight.normal_(0, 1.0)  # pre-activations of order 1, where tanh-GELU differs
    h = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_(True)
    out, _ = mlp(h)
    out.float().square().sum().backward()

    ref_params = {n: p.detach().clone().requires_grad_(True) for n, p in mlp.named_parameters()}
    h_ref = h.detach().clone().requires_grad_(True)
    y = F.linear(h_ref, ref_params["linear_fc1.weight"])
    act = _megatron_fused_activation(y, ref_params["linear_fc1.bias"], kind)
    ref = F.linear(act, ref_params["linear_fc2.weight"])
    ref.float().square().sum().backward()
    exact = {"gelu": F.gelu, "geglu": F.gelu, "swiglu": F.silu}[kind]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out, ref, **tol)
    grads = [("input", h.grad, h_ref.grad)] + [(n, p.grad, ref_params[n].grad) for n, p in mlp.named_parameters()]
    for name, ours, theirs in grads:
        assert (ours is None) == (theirs is None), name
        if ours is None:  # fc2's bias is returned apart (skip_bias_add), unused here
            continue
        if dtype == torch.float32:
            torch.testing.assert_close(ours, theirs, **tol, msg=lambda m: f"{name}: {m}")
        else:  # bf16 sums over tokens amplify single roundings where terms cancel: compare norms
            assert (ours.float() - theirs.float()).norm() <= 1e-2 * theirs.float().norm(), name
    if dtype == torch.float32 and kind != "swiglu":
        # Exact GELU (the unfused path) is measurably different: the test sees the approximation.
        yb = y.detach() + ref_params["linear_fc1.bias"].detach()
        unfused = exact(yb) if kind == "gelu" else exact(yb.chunk(2, -1)[0]) * yb.chunk(2, -1)[1]
        fused = _megatron_fused_activation(y.detach(), ref_params["linear_fc1.bias"].detach(), kind)
        assert (unfused - fused).abs().max() > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(FUSION_CASES))
def test_bias_activation_fusion_is_megatrons(pools, kind, dtype):
    pools(2).run(_case_bias_activation_fusion, kind, dtype)


@pytest.mark.parametrize("overrides,match", [
    (dict(activation_func=F.relu), "needs activation_func F.gelu .* or F.silu .*, got relu"),
    (dict(activation_func=F.silu), "needs gated_linear_unit=True"),
    (dict(add_bias_linear=False), "needs add_bias_linear=True"),
])
def test_bias_activation_fusion_rejects_what_megatron_rejects(overrides, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, bias_activation_fusion=True,
                          **overrides)


def test_bias_dropout_fusion_rounds_once():
    g = torch.Generator().manual_seed(0)
    x, bias, residual = (torch.randn(64, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    fused = bias_dropout_add(x, bias, residual, 0.0, False, fused=True)
    # Megatron's compiled bias_dropout_add: fp32 arithmetic, one rounding.
    assert torch.equal(fused, (residual.float() + (x.float() + bias.float())).to(torch.bfloat16))
    unfused = bias_dropout_add(x, bias, residual, 0.0, False)
    assert torch.equal(unfused, residual + (x + bias))


# ------------------------------------------------------------------ SwiGLU fc1 layout converter


def _megatron_swiglu_mlp(x, sd, prefix, tp):
    """Megatron's MLP with TP=`tp`: rank r's fc1 block output is chunked into
    [gate; up]; fc2 sums the ranks' partial products."""
    w1, b1 = sd[prefix + "linear_fc1.weight"], sd.get(prefix + "linear_fc1.bias")
    w2 = sd[prefix + "linear_fc2.weight"]
    out = 0
    for r, (w1_r, w2_r) in enumerate(zip(w1.chunk(tp), w2.chunk(tp, dim=1))):
        y = F.linear(x, w1_r, None if b1 is None else b1.chunk(tp)[r])
        gate, up = y.chunk(2, dim=-1)
        out = out + F.linear(F.silu(gate) * up, w2_r)
    b2 = sd.get(prefix + "linear_fc2.bias")
    return out if b2 is None else out + b2


def _case_megatron_layout():
    setup_parallel(1)
    cfg = make_config(gated_linear_unit=True, activation_func=F.silu, ffn_hidden_size=48)
    model = GPTModel(cfg, vocab_size=64, max_sequence_length=8)
    mlp = model.decoder.layers[0].mlp
    with torch.no_grad():
        mlp.linear_fc1.bias.normal_()
    ours = full_params(model)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0))
    expected, bias = mlp(x)
    expected = expected + bias
    for tp in (1, 2, 4):
        megatron = to_megatron_layout(ours, tp, gated_linear_unit=True)
        torch.testing.assert_close(_megatron_swiglu_mlp(x, megatron, "decoder.layers.0.mlp.", tp), expected,
                                   rtol=1e-5, atol=1e-6)
        back = from_megatron_layout(megatron, tp, gated_linear_unit=True)
        assert all(torch.equal(back[n], ours[n]) for n in ours), f"round trip at TP={tp} is not exact"
        if tp > 1:
            assert not torch.equal(megatron["decoder.layers.0.mlp.linear_fc1.weight"],
                                   to_megatron_layout(ours, 1, gated_linear_unit=True)[
                                       "decoder.layers.0.mlp.linear_fc1.weight"])
    assert to_megatron_layout(ours, 2, gated_linear_unit=False)["decoder.layers.0.mlp.linear_fc1.weight"] is \
        ours["decoder.layers.0.mlp.linear_fc1.weight"]
    with pytest.raises(ValueError, match="not 2 \\(gate, up\\) x 5"):
        to_megatron_layout(ours, 5, gated_linear_unit=True)


def test_swiglu_fc1_converts_to_and_from_megatron_layout(pools):
    pools(2).run(_case_megatron_layout)


# ------------------------------------------------------------------ perform_initialization=False, block arguments


def _case_biases_without_initialization():
    from megatron_fsdp.initialization import initialize_parameters

    setup_parallel(2)
    # Deterministic mode fills uninitialized memory with NaN, so a bias left
    # uninitialized cannot pass as zero by chance.
    torch.use_deterministic_algorithms(True)
    try:
        cfg = make_config(perform_initialization=False, qk_layernorm=True, add_qkv_bias=True)
        model = GPTModel(cfg, vocab_size=64, max_sequence_length=8)
        with torch.device("meta"):
            meta_model = GPTModel(cfg, vocab_size=64, max_sequence_length=8)
        meta_model.to_empty(device="cpu")
        initialize_parameters(meta_model)
    finally:
        torch.use_deterministic_algorithms(False)
    for m in (model, meta_model):
        params = full_params(m)
        biases = [n for n in params if n.endswith(".bias")]
        assert len(biases) > 10
        for name in biases:  # Megatron zeroes biases (linear and norm) whatever perform_initialization says
            assert torch.equal(params[name], torch.zeros_like(params[name])), name
        for name in (n for n in params if "layernorm" in n and n.endswith(".weight")):
            assert torch.equal(params[name], torch.ones_like(params[name])), name
        assert torch.isnan(params["decoder.layers.0.mlp.linear_fc1.weight"]).all()  # weights are left alone


def test_biases_are_zero_without_perform_initialization(pools):
    pools(2).run(_case_biases_without_initialization)


def _case_transformer_block_arguments():
    from megatron_fsdp.models.gpt import ModuleSpec
    from megatron_fsdp.transformer import TransformerBlock, TransformerLayer

    class MyLayer(TransformerLayer):
        pass

    setup_parallel(1)
    cfg = make_config()
    torch.manual_seed(0)
    block = TransformerBlock(cfg, ModuleSpec(module=MyLayer))
    assert all(type(layer) is MyLayer for layer in block.layers)
    torch.manual_seed(0)
    stage = TransformerBlock(cfg, MyLayer, pre_process=False, post_process=False)
    assert stage.final_layernorm is None
    h = torch.randn(8, 2, 32)
    with pytest.raises(ValueError, match="set_input_tensor"):
        stage(None, None)
    stage.set_input_tensor(h)
    # pre_process=False reads set_input_tensor's tensor, not the argument (Megatron's pipeline stage).
    expected = h
    for layer in block.layers:
        expected, _ = layer(expected, None)
    assert torch.equal(stage(torch.zeros_like(h), None), expected)
    with pytest.raises(TypeError, match="TransformerBlock spec must be None"):
        TransformerBlock(cfg, torch.nn.Linear)
    with pytest.raises(NotImplementedError, match="pg_collection=object is not supported"):
        TransformerBlock(cfg, pg_collection=object())
    with pytest.raises(NotImplementedError, match="vp_stage=1"):
        TransformerBlock(cfg, vp_stage=1)


def test_transformer_block_honours_or_rejects_its_arguments(pools):
    pools(2).run(_case_transformer_block_arguments)


# ------------------------------------------------------------------ fused cross entropy

def _case_cross_entropy_fusion_on_the_cpu(tp):
    """cross_entropy_loss_fusion on the CPU is the unfused loss on fp32 logits, whose gradient
    is rounded once to the logits' dtype. Same weights, same batch: the same loss and gradients,
    bit for bit, and the flag did choose the fused function (the CUDA kernels:
    tests/test_triton_cross_entropy.py)."""
    from megatron_fsdp.models.gpt import gpt_model

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    results = []
    fused, calls = gpt_model.fused_vocab_parallel_cross_entropy, []
    gpt_model.fused_vocab_parallel_cross_entropy = lambda *a, **k: calls.append(1) or fused(*a, **k)
    try:
        for fusion in (False, True):
            setup_parallel(tp)  # the same seed: the same weights
            model = GPTModel(make_config(bf16=True, params_dtype=torch.bfloat16, cross_entropy_loss_fusion=fusion),
                             vocab_size=64, max_sequence_length=16)
            loss = model(ids, torch.arange(16)[None], None, labels=ids)
            assert loss.shape == (2, 16) and loss.dtype == torch.float32
            loss.sum().backward()
            results.append((loss.detach(), full_grads(model)))
            parallel_state.destroy_model_parallel()
            assert len(calls) == fusion  # the flag chose the fused function, once per forward
    finally:
        gpt_model.fused_vocab_parallel_cross_entropy = fused
    (want_loss, want_grads), (loss, grads) = results
    assert torch.equal(loss, want_loss)
    for name, grad in want_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("tp", [1, 2])
def test_cross_entropy_fusion_on_the_cpu_is_the_unfused_loss(pools, tp):
    pools(2).run(_case_cross_entropy_fusion_on_the_cpu, tp)
