"""GPTModel at TP = 1, 2, 4 against a dense single-process reference."""

import pytest
import torch
import torch.nn.functional as F

import reference_gpt
from helpers import (FP32_TOLERANCE, assert_close_dicts, batch, full_grads, full_params, make_config,
                     setup_parallel, tiered)
from megatron_fsdp import parallel_state
from megatron_fsdp.models.gpt import GPTModel

VOCAB = 64

VARIANTS = {
    "plain": dict(),
    "gqa_swiglu_rope_rmsnorm": dict(
        config=dict(num_attention_heads=8, num_query_groups=4, gated_linear_unit=True, activation_func=F.silu,
                    normalization="RMSNorm", add_bias_linear=False),
        model=dict(position_embedding_type="rope")),
    "tied_qknorm_partial_rope": dict(
        config=dict(qk_layernorm=True, add_qkv_bias=True, layernorm_zero_centered_gamma=True),
        model=dict(share_embeddings_and_output_weights=True, position_embedding_type="rope",
                   rotary_percent=0.5)),
    "untied_no_position_embedding": dict(model=dict(position_embedding_type="none")),
}


def _padding_mask(b: int, s: int) -> torch.Tensor:
    """Megatron's bool mask [b, 1, s, s], True = masked: sample 1 ignores its first 3 keys."""
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    mask[1, :, :, :3] = True
    mask[1, :, :3, :] = False  # keep a key for the first queries so no row is all -inf
    mask[1, :, torch.arange(3), torch.arange(3)] = False
    return mask


def _case_parity(tp: int, sequence_parallel: bool, variant: str, masked: bool = False) -> None:
    setup_parallel(tp)
    spec = VARIANTS[variant]
    cfg = make_config(sequence_parallel=sequence_parallel, **spec.get("config", {}))
    model_kwargs = dict(vocab_size=VOCAB, max_sequence_length=16, **spec.get("model", {}))
    model = GPTModel(cfg, **model_kwargs)
    ids, labels, positions, weights = batch(VOCAB)

    attention_mask = _padding_mask(*ids.shape) if masked else None
    loss = model(ids, positions, attention_mask, labels=labels)
    (loss * weights).sum().backward()
    grads = full_grads(model)
    params = full_params(model)

    ref_params = {name: p.clone().requires_grad_(True) for name, p in params.items()}
    ref_loss = reference_gpt.gpt_forward(
        ref_params, cfg, ids, labels,
        position_embedding_type=model_kwargs.get("position_embedding_type", "learned_absolute"),
        tied=model_kwargs.get("share_embeddings_and_output_weights", False),
        rotary_percent=model_kwargs.get("rotary_percent", 1.0),
        attention_mask=attention_mask)
    (ref_loss * weights).sum().backward()

    torch.testing.assert_close(loss.detach(), ref_loss.detach(), **FP32_TOLERANCE)
    assert_close_dicts(grads, {n: p.grad for n, p in ref_params.items()}, "gradient")

    if masked:
        return
    # Logits path: [b, s, vocab/tp], or the full vocabulary with parallel_output=False.
    model.eval()
    logits = model(ids, positions, None)
    assert logits.shape == (2, 16, VOCAB // tp)
    model.parallel_output = False
    model.output_layer.gather_output = True
    full_logits = model(ids, positions, None)
    assert full_logits.shape == (2, 16, VOCAB)
    torch.testing.assert_close(F.cross_entropy(full_logits.reshape(-1, VOCAB), labels.reshape(-1),
                                               reduction="none").view(2, 16),
                               ref_loss.detach(), **FP32_TOLERANCE)


def _pairwise() -> list[tuple[int, bool, str]]:
    """(tp, sequence_parallel, variant): every variant at TP 1, 2 and 4, with and without sequence
    parallelism, and every (TP, sequence parallelism) pair: each pair of the three factors is
    covered, in 12 cases instead of the 20 of the whole grid."""
    cases = []
    for i, variant in enumerate(VARIANTS):
        cases += [(1, False, variant), (2, i % 2 == 1, variant), (4, i % 2 == 0, variant)]
    return cases


@pytest.mark.parametrize("tp,sequence_parallel,variant",
                         tiered(_pairwise(), [(1, False, "plain"), (2, True, "gqa_swiglu_rope_rmsnorm")]))
def test_gpt_matches_dense_reference(pools, tp, sequence_parallel, variant):
    pools(4).run(_case_parity, tp, sequence_parallel, variant)


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, True)])
@pytest.mark.slow  # pool cases
def test_gpt_with_attention_mask_matches_reference(pools, tp, sequence_parallel):
    pools(4).run(_case_parity, tp, sequence_parallel, "gqa_swiglu_rope_rmsnorm", masked=True)


def _full_weights_at(tp: int, variant: str) -> dict:
    setup_parallel(tp, seed=77)
    spec = VARIANTS[variant]
    model = GPTModel(make_config(**spec.get("config", {})), vocab_size=VOCAB, max_sequence_length=16,
                     **spec.get("model", {}))
    weights = full_params(model)
    parallel_state.destroy_model_parallel()
    return weights


def _case_init_is_tp_invariant(variant: str) -> None:
    reference = _full_weights_at(1, variant)
    for tp in (2, 4):
        weights = _full_weights_at(tp, variant)
        assert_close_dicts(weights, reference, f"TP={tp} initial weight", rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["plain", "gqa_swiglu_rope_rmsnorm"])
@pytest.mark.slow  # pool cases at three TP sizes
def test_initialization_is_identical_for_every_tp_size(pools, variant):
    pools(4).run(_case_init_is_tp_invariant, variant)
