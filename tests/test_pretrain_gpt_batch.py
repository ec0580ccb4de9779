"""examples/pretrain_gpt.py's get_batch: the dataset's plain causal mask stays off the device (the
model's causal attention applies it without the tensor), a --reset-attention-mask mask reaches the
model, and both give the model what the mask says."""

import argparse

import torch

from helpers import make_config, setup_parallel
from pretrain_in_pool import pretrain_gpt_module
from megatron_fsdp.datasets.masks import _get_ltor_masks_and_position_ids
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.training.global_vars import set_args

EOD = 0


def _batch(tokens: torch.Tensor, reset: bool) -> dict:
    """A collated micro-batch as GPTDataset and the DataLoader make it (masks [b, 1, s, s])."""
    samples = []
    for row in tokens:
        mask, loss_mask, positions = _get_ltor_masks_and_position_ids(row, EOD, reset, reset, False, True)
        samples.append({"tokens": row, "labels": torch.roll(row, -1), "loss_mask": loss_mask,
                        "attention_mask": mask, "position_ids": positions})
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def _case_get_batch_passes_only_masks_beyond_causal():
    setup_parallel(tp=1)
    pretrain_gpt = pretrain_gpt_module()
    model = GPTModel(make_config(), vocab_size=64, max_sequence_length=8, position_embedding_type="rope").eval()
    tokens = torch.tensor([[5, 9, EOD, 7, 3, 8, 2, 6], [4, 4, 1, 9, 9, EOD, 3, 2]])
    try:
        for reset in (False, True):
            set_args(argparse.Namespace(reset_attention_mask=reset))
            batch = _batch(tokens, reset)
            ids, labels, loss_mask, mask, positions = pretrain_gpt.get_batch(iter([dict(batch)]))
            assert torch.equal(ids, tokens) and torch.equal(positions, batch["position_ids"])
            masked = model(ids, positions, batch["attention_mask"], labels=labels)
            got = model(ids, positions, mask, labels=labels)
            if reset:  # documents apart: the mask reaches the model, and changes what it computes
                assert mask is not None and torch.equal(mask, batch["attention_mask"])
                assert not torch.allclose(got, model(ids, positions, None, labels=labels), atol=1e-3)
            else:  # the causal mask: left behind, and the causal attention computes the same
                assert mask is None
            torch.testing.assert_close(got, masked, rtol=1e-5, atol=1e-6)
    finally:
        set_args(None)


def test_get_batch_passes_only_masks_beyond_causal(pools):
    pools(1).run(_case_get_batch_passes_only_masks_beyond_causal)
