"""Hugging Face Llama-family weights <-> megatron_fsdp's GPT (dist_checkpointing/hf.py), against
what `transformers` computes: tiny random Llama (GQA; a head size other than hidden / heads),
Mistral and Qwen2 (q/k/v biases, tied embeddings) models converted to our GPT give their logits;
the mapping round-trips exactly; what we cannot represent is refused by name. The
mixture-of-experts models: test_hf_moe_interchange.py."""

import pytest
import torch

from megatron_fsdp.dist_checkpointing.hf import gpt_arguments, hf_to_megatron_fsdp, megatron_fsdp_to_hf

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_theta=50000.0)),
    # A head size (32) other than hidden / heads (16): our kv_channels.
    "llama_head_dim": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, head_dim=32)),
    # Llama 3.1's RoPE scaling; a context short enough that every frequency band is hit.
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, max_position_embeddings=16384, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                                      use_sliding_window=False)),
}


def _hf_model(name):
    config_cls, model_cls, extra = CONFIGS[name]
    fields = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, rms_norm_eps=1e-6)
    config = getattr(transformers, config_cls)(**{**fields, **extra})
    config.architectures = [model_cls]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    if name == "qwen2":  # random q/k/v biases: zeros would not test their placement
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model, config.to_dict()


def _case_logits_match(name):
    from megatron_fsdp import parallel_state, tensor_parallel
    from megatron_fsdp.models.gpt import GPTModel
    from megatron_fsdp.transformer import TransformerConfig

    hf_model, hf = _hf_model(name)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    fields, kwargs = gpt_arguments(hf)
    ours = GPTModel(TransformerConfig(**fields), **kwargs).eval()
    state = hf_to_megatron_fsdp(hf_model.state_dict(), hf)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    # Long enough for every RoPE frequency band to turn (Llama 3.1's scaling changes the slow ones).
    seq = 2048 if name == "llama3" else 16
    ids = torch.randint(0, 100, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits
        got = ours(ids, torch.arange(seq).expand(2, -1), attention_mask=None)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    back = megatron_fsdp_to_hf(state, hf)
    reference = hf_model.state_dict()
    if hf.get("tie_word_embeddings"):
        reference.pop("lm_head.weight")
    assert back.keys() == reference.keys()
    assert all(torch.equal(back[k], reference[k]) for k in back)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_converted_models_give_the_hf_logits_and_convert_back_exactly(pools, name):
    pools(1).run(_case_logits_match, name)


def test_llama3_rope_frequencies_are_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_fsdp.models.common.embeddings.rotary_pos_embedding import llama3_frequency_scaling

    _, hf = _hf_model("llama3")
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**hf), torch.device("cpu"))
    _, kwargs = gpt_arguments(hf)
    d = hf["hidden_size"] // hf["num_attention_heads"]
    plain = 1.0 / (kwargs["rotary_base"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    assert kwargs["rope_scaling"] and kwargs["rope_scaling_factor"] == 8.0
    torch.testing.assert_close(llama3_frequency_scaling(plain, kwargs["rope_scaling_factor"]), expected.float(),
                               rtol=1e-6, atol=0)
    assert not torch.allclose(plain, expected.float(), rtol=1e-3)  # the scaling changes some frequencies


def test_rope_theta_is_read_from_either_config_form():
    from megatron_fsdp.dist_checkpointing.hf import _rope

    assert _rope({"rope_theta": 500000.0, "rope_scaling": None}) == (500000.0, None)  # published config.json
    assert _rope({"rope_parameters": {"rope_type": "default", "rope_theta": 5e4}}) == (50000.0, None)  # transformers 5
    assert _rope({}) == (10000.0, None)


def test_padded_vocabulary_rows_are_added_on_import_and_dropped_on_export():
    model, hf = _hf_model("llama")
    state = hf_to_megatron_fsdp(model.state_dict(), hf, padded_vocab_size=128)
    assert state["embedding.word_embeddings.weight"].shape[0] == 128
    assert not state["output_layer.weight"][100:].any()
    back = megatron_fsdp_to_hf(state, hf)
    assert torch.equal(back["lm_head.weight"], model.state_dict()["lm_head.weight"])


@pytest.mark.parametrize("change, error, message", [
    (dict(architectures=["GPTNeoXForCausalLM"]), ValueError, r"architectures \['GPTNeoXForCausalLM'\]: supported are"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), NotImplementedError, "rope_scaling=.*yarn.* not supported"),
    (dict(rope_scaling=None, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                                              "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}),
     NotImplementedError, "rope_scaling=.*'low_freq_factor': 2.0.* not supported"),  # transformers 5's form
    (dict(sliding_window=4096, use_sliding_window=True), NotImplementedError, "sliding_window=4096"),
    (dict(hidden_act="gelu"), ValueError, "hidden_act='gelu': only SwiGLU"),
    (dict(layer_types=["sliding_attention", "full_attention"]), NotImplementedError, "layer_types with"),
])
def test_what_we_cannot_represent_is_refused_by_name(change, error, message):
    _, hf = _hf_model("llama")
    with pytest.raises(error, match=message):
        gpt_arguments({**hf, **change})
