"""Bad configuration gets a clear error naming the bad value, before any work."""

import inspect

import pytest
import torch

from helpers import make_config, setup_parallel
from megatron_fsdp.models.gpt import GPTModel, ModuleSpec, get_gpt_layer_local_spec
from megatron_fsdp.transformer import TransformerConfig, TransformerLayer

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4)


@pytest.mark.parametrize("overrides,error,match", [
    (dict(num_attention_heads=6, hidden_size=36, tensor_model_parallel_size=4), ValueError,
     r"num_attention_heads \(6\) must be divisible by tensor_model_parallel_size \(4\)"),
    (dict(hidden_size=30), ValueError, r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"),
    (dict(num_query_groups=3), ValueError, r"divisible by num_query_groups \(3\)"),
    (dict(num_attention_heads=8, num_query_groups=2, tensor_model_parallel_size=4), ValueError,
     r"num_query_groups \(2\) must be divisible by tensor_model_parallel_size \(4\)"),
    (dict(ffn_hidden_size=30, tensor_model_parallel_size=4), ValueError, r"ffn_hidden_size \(30\)"),
    (dict(num_layers=0), ValueError, r"num_layers must be a positive integer, got 0"),
    (dict(normalization="BatchNorm"), ValueError, r"normalization must be one of .* got 'BatchNorm'"),
    (dict(hidden_dropout=1.5), ValueError, r"hidden_dropout must be in \[0, 1\), got 1.5"),
    (dict(recompute_granularity="full"), ValueError, r"recompute_method 'uniform' or 'block'"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3), ValueError,
     r"recompute_num_layers must be an integer in \[1, num_layers=2\]"),
    (dict(recompute_granularity="partial"), ValueError, r"recompute_granularity must be one of"),
    (dict(recompute_method="block"), ValueError, r"recompute_granularity is None"),
    (dict(recompute_granularity="selective", recompute_modules=["mlp"]), ValueError, r"\['mlp'\]"),
    (dict(fp8="e5m2"), ValueError, r"fp8 must be one of \('e4m3', 'hybrid'\) or None, got 'e5m2'"),
    (dict(fp8="hybrid", fp8_recipe="mxfp8"), NotImplementedError,
     r"fp8_recipe='mxfp8' is not supported by megatron_fsdp \(supported: \('tensorwise', 'delayed', 'rowwise'\)\)"),
    (dict(fp8="e4m3", fp8_recipe="blockwise"), NotImplementedError, r"fp8_recipe='blockwise' is not supported"),
    (dict(fp8="e4m3", fp8_recipe="current"), ValueError, r"fp8_recipe must be one of .* got 'current'"),
    (dict(fp8="hybrid", fp8_amax_history_len=0), ValueError, r"fp8_amax_history_len must be an integer >= 1, got 0"),
    (dict(fp8="hybrid", fp8_amax_compute_algo="mean"), ValueError, r"fp8_amax_compute_algo must be one of"),
    (dict(fp8="hybrid", fp8_margin=0.5), ValueError, r"fp8_margin must be an integer, got 0.5"),
    (dict(fp8_param=True), ValueError, r"fp8_param must be used together with fp8"),
    (dict(fp8="hybrid", first_last_layers_bf16=True, num_layers_at_end_in_bf16=3), ValueError,
     r"num_layers_at_end_in_bf16 \(3\) must be between 0 and num_layers \(2\)"),
    (dict(fp8="hybrid", fp8_dot_product_attention=True), NotImplementedError, r"fp8_dot_product_attention=True"),
    (dict(fp8="hybrid", tp_only_amax_red=True), NotImplementedError, r"tp_only_amax_red=True .* reduced over both"),
    (dict(fp8="hybrid", fp8_interval=2), NotImplementedError, r"fp8_interval=2"),
    (dict(num_moe_experts=8), NotImplementedError, r"add_bias_linear=True .* mixture-of-experts layers have no biases"),
    (dict(num_moe_experts=0, add_bias_linear=False), ValueError, r"num_moe_experts must be a positive integer, got 0"),
    (dict(num_moe_experts=2, moe_router_topk=3, add_bias_linear=False), ValueError,
     r"moe_router_topk \(3\) must be at most num_moe_experts \(2\)"),
    (dict(num_moe_experts=6, expert_model_parallel_size=4, add_bias_linear=False), ValueError,
     r"num_moe_experts \(6\) must be divisible by expert_model_parallel_size \(4\)"),
    (dict(num_moe_experts=4, tensor_model_parallel_size=2, add_bias_linear=False), ValueError,
     r"tensor_model_parallel_size > 1 need sequence_parallel=True"),
    (dict(num_moe_experts=4, moe_router_topk=1, add_bias_linear=False), ValueError,
     r"moe_router_topk=1 with softmax scores needs moe_router_pre_softmax=True"),
    (dict(num_moe_experts=4, moe_router_enable_expert_bias=True, add_bias_linear=False), ValueError,
     r"moe_router_enable_expert_bias .* needs moe_router_score_function='sigmoid'"),
    (dict(num_moe_experts=4, moe_router_load_balancing_type="sinkhorn", add_bias_linear=False), ValueError,
     r"moe_router_load_balancing_type='sinkhorn' is not supported \(one of 'aux_loss', 'seq_aux_loss', 'none'\)"),
    (dict(num_moe_experts=4, moe_token_dispatcher_type="flex", add_bias_linear=False), ValueError,
     r"moe_token_dispatcher_type='flex' is not supported"),
    (dict(num_moe_experts=4, moe_pad_expert_input_to_capacity=True, add_bias_linear=False), ValueError,
     r"moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor"),
    (dict(num_moe_experts=4, moe_layer_freq=[1, 0, 1], add_bias_linear=False), ValueError,
     r"one 0 \(dense\) or 1 \(MoE\) per layer \(2\), got \[1, 0, 1\]"),
    (dict(num_moe_experts=4, moe_shared_expert_gate=True, add_bias_linear=False), ValueError,
     r"moe_shared_expert_gate needs moe_shared_expert_intermediate_size"),
    (dict(num_moe_experts=4, moe_router_group_topk=2, add_bias_linear=False), NotImplementedError,
     r"moe_router_group_topk=2 .* group-limited routing is not supported"),
    (dict(num_moe_experts=4, fp8="hybrid", add_bias_linear=False), NotImplementedError,
     r"fp8='hybrid' .* fp8 expert GEMMs are not supported yet"),
    (dict(pipeline_model_parallel_size=2), NotImplementedError, r"pipeline_model_parallel_size=2"),
    (dict(gradient_accumulation_fusion=True), NotImplementedError, r"gradient_accumulation_fusion=True"),
    (dict(distribute_saved_activations=True), NotImplementedError, r"distribute_saved_activations"),
    (dict(fp16=True, bf16=True), ValueError, r"fp16 and bf16 cannot both be True"),
    (dict(params_dtype=torch.int32), ValueError, r"params_dtype must be a floating-point"),
    (dict(tensor_model_parallel_size=0), ValueError, r"tensor_model_parallel_size must be a positive integer"),
    (dict(cross_entropy_fusion_impl="apex"), ValueError, r"cross_entropy_fusion_impl='apex', allowed: 'native', 'te'"),
    (dict(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te"), NotImplementedError,
     r"cross_entropy_fusion_impl='te' is not supported by megatron_fsdp \(only 'native'\): Transformer Engine's"),
])
def test_transformer_config_rejects(overrides, error, match):
    with pytest.raises(error, match=match):
        TransformerConfig(**{**BASE, **overrides})


def test_transformer_config_fp8_fields_have_megatron_defaults():
    cfg = TransformerConfig(**BASE)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.fp8_margin, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo,
            cfg.fp8_wgrad, cfg.fp8_param, cfg.first_last_layers_bf16, cfg.num_layers_at_start_in_bf16,
            cfg.num_layers_at_end_in_bf16) == (None, "delayed", 0, 1, "most_recent", True, False, False, 1, 1)
    for fmt in ("e4m3", "hybrid"):
        for recipe in ("tensorwise", "delayed", "rowwise"):
            TransformerConfig(**BASE, fp8=fmt, fp8_recipe=recipe, fp8_amax_compute_algo="max",
                              fp8_amax_history_len=16, first_last_layers_bf16=True, fp8_param=True)


def test_transformer_config_derives_megatron_defaults():
    cfg = TransformerConfig(**BASE)
    assert (cfg.kv_channels, cfg.ffn_hidden_size, cfg.num_query_groups) == (8, 128, 4)
    assert callable(cfg.init_method) and callable(cfg.output_layer_init_method)
    # Fusion flags select Megatron's fused numerics (tests/test_megatron_numerics.py); no warning.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TransformerConfig(**BASE, bias_activation_fusion=True, bias_dropout_fusion=True, apply_rope_fusion=True,
                          masked_softmax_fusion=True, persist_layer_norm=True)


def _case_gpt_model_errors(case):
    setup_parallel(tp=2)
    if case == "tp_mismatch":
        GPTModel(make_config(tensor_model_parallel_size=1), vocab_size=64, max_sequence_length=16)
    elif case == "vocab":
        GPTModel(make_config(), vocab_size=63, max_sequence_length=16)
    elif case == "pipeline":
        GPTModel(make_config(), vocab_size=64, max_sequence_length=16, post_process=False)
    elif case == "spec":
        GPTModel(make_config(), transformer_layer_spec=ModuleSpec(module=torch.nn.Linear), vocab_size=64,
                 max_sequence_length=16)
    elif case == "position_type":
        GPTModel(make_config(), vocab_size=64, max_sequence_length=16, position_embedding_type="alibi")
    elif case == "too_long":
        model = GPTModel(make_config(), vocab_size=64, max_sequence_length=8)
        ids = torch.zeros(1, 16, dtype=torch.long)
        model(ids, torch.arange(16)[None], None)
    elif case == "sp_seq_len":
        model = GPTModel(make_config(sequence_parallel=True), vocab_size=64, max_sequence_length=16,
                         position_embedding_type="rope")
        model(torch.zeros(1, 15, dtype=torch.long), None, None)
    elif case == "context_parallel":
        GPTModel(make_config(context_parallel_size=2), vocab_size=64, max_sequence_length=16)
    else:
        raise AssertionError(case)


@pytest.mark.parametrize("case,error,match", [
    ("tp_mismatch", "ValueError", "config.tensor_model_parallel_size (1) differs from the initialized "
                                  "tensor-parallel size (2)"),
    ("vocab", "ValueError", "vocabulary size 63 is not divisible by the tensor-parallel size 2"),
    ("pipeline", "NotImplementedError", "pipeline stages"),
    ("spec", "TypeError", "transformer_layer_spec must be None"),
    ("position_type", "ValueError", "got 'alibi'"),
    ("too_long", "ValueError", "sequence length 16 exceeds max_sequence_length 8"),
    ("sp_seq_len", "ValueError", "sequence length 15 is not divisible by the tensor-parallel size 2"),
    ("context_parallel", "ValueError", "config.context_parallel_size (2) differs from the initialized "
                                       "context-parallel size (1)"),
])
def test_gpt_model_rejects_on_every_rank(pools, case, error, match):
    errors = pools(2).run_expecting_errors(_case_gpt_model_errors, case)
    for e in errors:
        assert e.type_name == error and match in e.message, f"rank {e.rank}: {e.type_name}: {e.message}"


def test_layer_specs_name_the_layer():
    assert get_gpt_layer_local_spec().module is TransformerLayer
    assert get_gpt_layer_local_spec(num_experts=4).module is TransformerLayer  # MoE layers: the config's


# Megatron-Core 0.19's forward parameters, in order (TransformerLayer.forward
# takes *args/**kwargs there and hands them to _forward_attention, listed here).
MEGATRON_FORWARD_PARAMETERS = {
    "SelfAttention": ["hidden_states", "attention_mask", "key_value_states", "inference_context", "rotary_pos_emb",
                      "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "attention_bias",
                      "packed_seq_params", "sequence_len_offset", "*inference_params"],
    "TransformerLayer": ["hidden_states", "attention_mask", "context", "context_mask", "rotary_pos_emb",
                         "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "attention_bias",
                         "inference_context", "packed_seq_params", "sequence_len_offset", "padding_mask",
                         "*inference_params"],
    "TransformerBlock": ["hidden_states", "attention_mask", "context", "context_mask", "rotary_pos_emb",
                         "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "attention_bias",
                         "inference_context", "packed_seq_params", "sequence_len_offset", "padding_mask",
                         "extract_layer_indices", "*inference_params", "*dynamic_inference_decode_only"],
    "MLP": ["hidden_states", "per_token_scale"],
    "GPTModel": ["input_ids", "position_ids", "attention_mask", "decoder_input", "labels", "inference_context",
                 "packed_seq_params", "extra_block_kwargs", "runtime_gather_output", "*inference_params",
                 "*loss_mask", "*padding_mask", "*output_processor", "*output_processor_context"],
}


def test_forward_signatures_match_megatron():
    from megatron_fsdp.transformer import MLP, SelfAttention, TransformerBlock

    classes = {"SelfAttention": SelfAttention, "TransformerLayer": TransformerLayer,
               "TransformerBlock": TransformerBlock, "MLP": MLP, "GPTModel": GPTModel}
    for name, expected in MEGATRON_FORWARD_PARAMETERS.items():
        params = list(inspect.signature(classes[name].forward).parameters.values())[1:]
        got = [("*" if p.kind is p.KEYWORD_ONLY else "") + p.name for p in params]
        # Megatron's MLP takes **kwargs (the layer passes padding_mask); ours names it.
        assert got[:len(expected)] == expected and all(g.startswith("*") for g in got[len(expected):]), \
            f"{name}.forward: {got}"


def _case_megatron_forward_arguments():
    setup_parallel(tp=1)
    model = GPTModel(make_config(), vocab_size=64, max_sequence_length=8, position_embedding_type="none")
    block, layer = model.decoder, model.decoder.layers[0]
    h = torch.randn(8, 2, 32)
    # Megatron's keyword names, with None, run as they do there.
    out = block(h, None, context=None, context_mask=None, rotary_pos_emb=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, inference_params=None)
    assert out.shape == h.shape
    hidden, context = layer(h, None, context=None, rotary_pos_emb=None, packed_seq_params=None)
    assert hidden.shape == h.shape and context is None
    # A value for a feature megatron_fsdp lacks raises instead of being ignored.
    with pytest.raises(NotImplementedError, match="TransformerBlock.forward: packed_seq_params=object is not supported"):
        block(h, None, packed_seq_params=object())
    with pytest.raises(NotImplementedError, match="TransformerLayer.forward: context=Tensor is not supported"):
        layer(h, None, h)  # Megatron's third positional argument is the cross-attention context
    with pytest.raises(NotImplementedError, match="SelfAttention.forward: rotary_pos_cos=Tensor is not supported"):
        layer.self_attention(h, None, rotary_pos_cos=h)
    with pytest.raises(NotImplementedError, match="DotProductAttention.forward: attention_bias=Tensor is not supported"):
        q = torch.randn(8, 2, 4, 8)
        layer.self_attention.core_attention(q, q, q, None, attention_bias=q)
    # Positional order is Megatron 0.19's: the 8th argument is rotary_pos_cos_sin.
    for module, name in ((block, "TransformerBlock"), (layer, "TransformerLayer")):
        with pytest.raises(NotImplementedError, match=f"{name}.forward: rotary_pos_cos_sin=Tensor is not supported"):
            module(h, None, None, None, None, None, None, h)
    with pytest.raises(NotImplementedError, match="dynamic_inference_decode_only=True is not supported"):
        block(h, None, dynamic_inference_decode_only=True)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(NotImplementedError, match="GPTModel.forward: output_processor=function is not supported"):
        model(ids, None, None, output_processor=lambda **kw: None)
    with pytest.raises(TypeError):
        model(ids, None, None, None, None, None, None, None, None, None)  # loss_mask is keyword-only

    # padding_mask only steers MoE routing in Megatron: no change for dense layers.
    reference = model(ids, None, None, labels=ids)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[1, :3] = True
    assert torch.equal(model(ids, None, None, labels=ids, padding_mask=padding), reference)
    with pytest.raises(ValueError, match=r"padding_mask has shape \(2, 7\), expected input_ids' shape \(2, 8\)"):
        model(ids, None, None, padding_mask=padding[:, :7])

    # per_token_scale multiplies each token's fc1 activations; fc2 is linear in them.
    mlp = layer.mlp
    plain, _ = mlp(h)
    scale = torch.full((8, 2), 2.0)
    scale[0] = 0.0
    scaled, _ = mlp(h, scale)
    torch.testing.assert_close(scaled[1:], 2 * plain[1:])
    assert torch.equal(scaled[0], torch.zeros_like(scaled[0]))
    with pytest.raises(ValueError, match=r"per_token_scale has shape \(2, 8\)"):
        mlp(h, scale.t())


def test_megatron_forward_arguments_for_missing_features_raise(pools):
    pools(2).run(_case_megatron_forward_arguments)


def _block_outputs(block, h, extract):
    h = h.detach().requires_grad_(True)
    out = block(h, None, extract_layer_indices=extract)
    out, kept = out if extract else (out, [])
    (out.sum() + sum(k.square().sum() for k in kept)).backward()
    return out.detach(), [k.detach() for k in kept], h.grad


def _case_extract_layer_indices(sequence_parallel: bool):
    setup_parallel(tp=2)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    h = torch.randn(8 // (2 if sequence_parallel else 1), 2, 32, generator=torch.Generator().manual_seed(0))
    results = {}
    for name, extra in (("plain", {}), ("recompute", recompute)):
        torch.manual_seed(5)
        model = GPTModel(make_config(num_layers=3, sequence_parallel=sequence_parallel, **extra), vocab_size=64,
                         max_sequence_length=8).train()
        block = model.decoder
        # The hidden states after layers 0 and 2, before the final norm, in layer order.
        expected, layer_outputs = h, []
        for layer in block.layers:
            expected, _ = layer(expected, None)
            layer_outputs.append(expected.detach())
        out, kept, grad = _block_outputs(block, h, {2, 0})
        assert torch.equal(out, block.final_layernorm(layer_outputs[-1]).detach())
        assert len(kept) == 2 and torch.equal(kept[0], layer_outputs[0]) and torch.equal(kept[1], layer_outputs[2])
        results[name] = (out, kept, grad)
        plain_out, _, plain_grad = _block_outputs(block, h, None)
        assert torch.equal(plain_out, out) and not torch.equal(plain_grad, grad)  # the extracted states add gradient
        with pytest.raises(ValueError, match=r"extract_layer_indices must be a set of layer indices in \[0, 3\)"):
            block(h, None, extract_layer_indices={3})
        ids, positions = torch.zeros(2, 8, dtype=torch.long), torch.arange(8).expand(2, 8)
        with pytest.raises(ValueError, match="extract_layer_indices in extra_block_kwargs"):
            model(ids, positions, None, extra_block_kwargs={"extract_layer_indices": {0}})
        # padding_mask reaches the layers (split over TP ranks under sequence parallelism) without effect.
        padding = torch.zeros(2, 8, dtype=torch.bool)
        padding[0, 5:] = True
        assert torch.equal(model(ids, positions, None, labels=ids, padding_mask=padding),
                           model(ids, positions, None, labels=ids))
    torch.testing.assert_close(results["recompute"][2], results["plain"][2])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_extract_layer_indices(pools, sequence_parallel):
    pools(2).run(_case_extract_layer_indices, sequence_parallel)


SPLIT_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--micro-batch-size", "2", "--lr", "1e-3", "--vocab-size", "64", "--train-iters", "4",
               "--data-path", "corpus_text_document"]


def _parse_on_rank(rank, *flags):
    import os
    from unittest import mock

    from megatron_fsdp.training.arguments import parse_args
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": str(rank)}):
        return parse_args([*SPLIT_FLAGS, *flags])


@pytest.mark.parametrize("split,message", [
    ("100,-5,5", "--split '100,-5,5': '-5' is negative; --split takes up to three non-negative numbers"),
    ("90,x,10", "--split '90,x,10': 'x' is not a finite number"),
    ("0,0,0", "--split '0,0,0' gives every split a zero share"),
    ("1,,1", "--split '1,,1' has an empty part"),
])
def test_a_bad_split_flag_is_one_line_on_rank_zero_with_exit_code_2(split, message, capsys):
    """As the other flag errors (training/arguments.py): before any process group, not a traceback per rank."""
    with pytest.raises(SystemExit) as exit_info:
        _parse_on_rank(0, "--split", split)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    with pytest.raises(SystemExit) as exit_info:
        _parse_on_rank(1, "--split", split)
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


def test_a_good_split_flag_and_the_default_pass():
    assert _parse_on_rank(0, "--split", "98,2").split == "98,2"
    assert _parse_on_rank(0).split == "969, 30, 1"
