"""Megatron's spec getters decide what their submodules decide there: query/key
normalization and, when given, the norm type, whatever the config says."""

import pytest

from helpers import make_config, setup_parallel
from megatron_fsdp.models.gpt import (GPTModel, get_gpt_layer_local_spec,
                                      get_gpt_layer_with_transformer_engine_spec)
from megatron_fsdp.transformer import TransformerLayer


def _case_spec_overrides_config():
    from megatron_fsdp.transformer.norms import RMSNorm

    setup_parallel(1)
    found = {}
    for config_qk in (False, True):
        for spec_qk in (False, True):
            model = GPTModel(make_config(qk_layernorm=config_qk), get_gpt_layer_local_spec(qk_layernorm=spec_qk),
                             vocab_size=64, max_sequence_length=8)
            attn = model.decoder.layers[0].self_attention
            found[(config_qk, spec_qk)] = (attn.q_layernorm is not None, attn.k_layernorm is not None)
            assert isinstance(model.decoder.layers[0], TransformerLayer)
            assert model.config.qk_layernorm is config_qk  # the model's config is not changed
    rms = GPTModel(make_config(), get_gpt_layer_local_spec(normalization="RMSNorm"),
                   vocab_size=64, max_sequence_length=8)
    te = GPTModel(make_config(qk_layernorm=True), get_gpt_layer_with_transformer_engine_spec(),
                  vocab_size=64, max_sequence_length=8)
    return (found, isinstance(rms.decoder.layers[0].input_layernorm, RMSNorm),
            te.decoder.layers[0].self_attention.q_layernorm is None)


def test_spec_decides_qk_layernorm_and_norm_type(pools):
    found, rms, te_without_qk = pools(1).run(_case_spec_overrides_config)[0]
    assert found == {(c, s): (s, s) for c in (False, True) for s in (False, True)}
    assert rms and te_without_qk


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_experts=0), ValueError, "num_moe_experts=0; allowed: a positive int"),
    (dict(moe_grouped_gemm=True), ValueError, "moe_grouped_gemm=True needs num_experts"),
    (dict(multi_latent_attention=True), NotImplementedError, "multi-latent attention"),
    (dict(qk_l2_norm=True), NotImplementedError, "qk_l2_norm=True"),
    (dict(use_kitchen=True), NotImplementedError, "use_kitchen=True"),
    (dict(normalization="BatchNorm"), ValueError, "normalization='BatchNorm'"),
    (dict(no_such_option=1), TypeError, "no_such_option"),
])
def test_spec_getters_reject_what_they_cannot_honour(kwargs, error, match):
    with pytest.raises(error, match=match):
        get_gpt_layer_local_spec(**kwargs)


def test_moe_specs_pin_the_expert_count_and_the_gemm_choice():
    from megatron_fsdp.models.gpt import get_gpt_decoder_block_spec
    from megatron_fsdp.transformer import TransformerConfig

    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=True)
    assert spec.params == {"qk_layernorm": False, "num_moe_experts": 8, "moe_grouped_gemm": True}
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4,
                               add_bias_linear=False, qk_layernorm=True)
    assert get_gpt_decoder_block_spec(config, use_transformer_engine=False).params == {
        "qk_layernorm": True, "num_moe_experts": 4, "moe_grouped_gemm": False}
    with pytest.raises(NotImplementedError, match="vp_stage=1"):
        get_gpt_decoder_block_spec(config, vp_stage=1)


def test_spec_getters_accept_megatrons_unused_fp8_argument():
    assert get_gpt_layer_local_spec(fp8="hybrid").params == {"qk_layernorm": False}
