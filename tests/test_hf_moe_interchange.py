"""Hugging Face mixture-of-experts weights <-> megatron_fsdp's GPT (dist_checkpointing/hf_moe.py),
against what `transformers` computes: tiny random Mixtral, Qwen2-MoE (a shared expert and its gate,
q/k/v biases, a dense layer) and Qwen3-MoE (query/key norms, a head size other than hidden / heads,
top-k weights renormalized or not, sparse every second layer) converted to our GPT give their
logits, and the other routing rule does not; the mapping round-trips exactly; what we cannot
represent is refused by name, both ways."""

import pytest

from hf_moe_cases import CONFIGS, case_mapping_gives_the_hf_logits, hf_moe_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_converted_moe_models_give_the_hf_logits_and_convert_back_exactly(pools, name):
    exact, other_routing = pools(1).run(case_mapping_gives_the_hf_logits, name)[0]
    assert exact < 1e-5, exact
    assert other_routing > 1e-3, other_routing  # the routing rule matters to these logits


def _config(name, **change):
    _, hf = hf_moe_model(name)
    hf.update(change)
    return hf


@pytest.mark.parametrize("name, change, error, message", [
    ("mixtral", dict(router_jitter_noise=0.1), NotImplementedError, "router_jitter_noise=0.1: the router's input"),
    ("mixtral", dict(num_experts_per_tok=1), NotImplementedError, "num_experts_per_tok=1 with renormalized top-k"),
    ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=True), NotImplementedError,
     "num_experts_per_tok=1 with renormalized"),
    ("mixtral", dict(num_experts_per_tok=5), ValueError, "num_experts_per_tok=5: must be between 1 and the 4"),
    ("mixtral", dict(sliding_window=4096), NotImplementedError, "sliding_window=4096"),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8), NotImplementedError, "sliding_window=8"),
    ("qwen2_moe", dict(layer_types=["full_attention", "sliding_attention", "full_attention"]),
     NotImplementedError, r"layer_types with \['sliding_attention'\]"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), NotImplementedError,
     "shared_expert_intermediate_size=0: a Qwen2-MoE without a shared expert"),
    ("qwen2_moe", dict(num_experts=0), NotImplementedError, "num_experts=0: a model without experts"),
    ("qwen2_moe", dict(mlp_only_layers=[3]), ValueError, r"mlp_only_layers=\[3\]: must list layer indices below 3"),
    ("qwen2_moe", dict(decoder_sparse_step=0), ValueError, "decoder_sparse_step=0"),
    ("qwen3_moe", dict(attention_bias=True), NotImplementedError, "attention_bias/mlp_bias"),
    ("qwen3_moe", dict(hidden_act="gelu"), ValueError, "hidden_act='gelu'"),
    ("qwen3_moe", dict(architectures=["Qwen3MoeForCausalLM", "MixtralForCausalLM"]), ValueError,
     "a mixture-of-experts model names one"),
])
def test_what_a_moe_model_cannot_be_is_refused_by_name(name, change, error, message):
    from megatron_fsdp.dist_checkpointing.hf import gpt_arguments

    with pytest.raises(error, match=message):
        gpt_arguments(_config(name, **change))


def test_moe_config_fields_and_flags():
    """The routing rule, the layer pattern and the sizes each model's config means."""
    from megatron_fsdp.dist_checkpointing.hf import gpt_arguments, model_args

    mixtral, _ = gpt_arguments(_config("mixtral"))
    assert (mixtral["moe_router_pre_softmax"], mixtral["moe_layer_freq"], mixtral["moe_ffn_hidden_size"]) == (
        False, 1, 48)
    assert mixtral["moe_aux_loss_coeff"] == 0.02 and mixtral["kv_channels"] == 8
    qwen2 = model_args(_config("qwen2_moe"))
    assert (qwen2["moe_layer_freq"], qwen2["moe_router_pre_softmax"], qwen2["add_qkv_bias"]) == ([1, 0, 1], True, True)
    assert (qwen2["moe_shared_expert_intermediate_size"], qwen2["moe_shared_expert_gate"]) == (12, True)
    assert (qwen2["ffn_hidden_size"], qwen2["moe_ffn_hidden_size"], qwen2["num_experts"]) == (48, 8, 4)
    qwen3 = model_args(_config("qwen3_moe_norm"))
    assert (qwen3["moe_layer_freq"], qwen3["moe_router_pre_softmax"], qwen3["moe_router_topk"]) == ([0, 1, 0], False, 3)
    assert (qwen3["qk_layernorm"], qwen3["kv_channels"], qwen3["add_qkv_bias"]) == (True, 16, False)
    # Qwen3-MoE's config.json (as transformers 5 saves it) says num_local_experts; published ones num_experts.
    assert "num_experts" not in _config("qwen3_moe") and model_args(_config("qwen3_moe"))["num_experts"] == 4


MOE_ARGS = dict(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                group_query_attention=True, kv_channels=8, swiglu=True, normalization="RMSNorm",
                disable_bias_linear=True, position_embedding_type="rope", max_position_embeddings=64,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_layer_freq=1)


@pytest.mark.parametrize("change, architecture", [
    (dict(), "MixtralForCausalLM"),
    (dict(moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True, add_qkv_bias=True),
     "Qwen2MoeForCausalLM"),
    (dict(add_qkv_bias=True, moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True,
          moe_router_pre_softmax=True, moe_layer_freq=[1, 0]), "Qwen2MoeForCausalLM"),
    (dict(qk_layernorm=True, moe_layer_freq=2, kv_channels=16), "Qwen3MoeForCausalLM"),
])
def test_the_export_architecture_comes_from_the_flags(change, architecture):
    from megatron_fsdp.dist_checkpointing.hf import gpt_arguments, hf_config

    config = hf_config({**MOE_ARGS, **change}, 100, __import__("torch").float32)
    assert config["architectures"] == [architecture]
    fields, _ = gpt_arguments(config)  # and reads back as the flags said
    assert fields["qk_layernorm"] is bool(change.get("qk_layernorm"))
    assert fields["moe_router_pre_softmax"] is bool(change.get("moe_router_pre_softmax"))
    freq = change.get("moe_layer_freq", 1)
    assert fields["moe_layer_freq"] == ([1, 0] if freq == 2 else freq) and fields["kv_channels"] == change.get(
        "kv_channels", 8)


@pytest.mark.parametrize("change, message", [
    (dict(moe_router_pre_softmax=True), "Mixtral.* needs top-k then softmax routing"),
    (dict(moe_layer_freq=[1, 0]), r"MixtralForCausalLM needs experts in every layer \(--moe-layer-freq \[1, 0\]\)"),
    (dict(moe_shared_expert_intermediate_size=12), "Qwen2MoeForCausalLM needs a shared expert with its gate"),
    (dict(add_qkv_bias=True), "Qwen2MoeForCausalLM needs a shared expert with its gate"),
    (dict(qk_layernorm=True, add_qkv_bias=True), "Qwen3MoeForCausalLM needs no q/k/v biases"),
    (dict(qk_layernorm=True, moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True),
     "Qwen3MoeForCausalLM needs no shared expert"),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
     "needs --moe-router-score-function sigmoid .softmax only.; --moe-router-enable-expert-bias"),
    (dict(moe_router_topk_scaling_factor=2.5), "--moe-router-topk-scaling-factor 2.5 .none."),
])
def test_what_an_hf_moe_architecture_cannot_hold_is_refused_in_one_line(change, message):
    import torch

    from megatron_fsdp.dist_checkpointing.hf import hf_config

    with pytest.raises(NotImplementedError, match=message) as refused:
        hf_config({**MOE_ARGS, **change}, 100, torch.float32)
    assert "\n" not in str(refused.value)


def test_a_dense_export_refuses_query_key_norms():
    import torch

    from megatron_fsdp.dist_checkpointing.hf import hf_config

    dense = {k: v for k, v in MOE_ARGS.items() if k not in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                                          "moe_layer_freq")}
    with pytest.raises(NotImplementedError, match=r"Llama-family model needs no --qk-layernorm \(query/key norms"):
        hf_config({**dense, "qk_layernorm": True}, 100, torch.float32)
