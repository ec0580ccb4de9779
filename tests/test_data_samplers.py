"""Megatron's pretraining sampler and data loader: resume continues at the next sample, at any DP size."""

from types import SimpleNamespace

import pytest
import torch

import dataset_reference as ref
from megatron_fsdp.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_fsdp.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_fsdp.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)
from megatron_fsdp.training.tokenizer.null_tokenizer import NullTokenizer


def _global_steps(total, consumed, micro_batch, dp, steps):
    """Samples of each step over all ranks: rank r's batch at step k is its slice of the step."""
    per_rank = [list(MegatronPretrainingSampler(total, consumed, micro_batch, r, dp)) for r in range(dp)]
    return [sum((per_rank[r][k] for r in range(dp)), []) for k in range(steps)]


def test_sampler_walks_the_global_order():
    assert list(MegatronPretrainingSampler(10, 0, 2, 1, 2)) == [[2, 3], [6, 7]]  # 8, 9 complete no step
    assert list(MegatronPretrainingSampler(10, 4, 2, 0, 2)) == [[4, 5]]
    assert list(MegatronPretrainingSampler(11, 8, 2, 1, 2, drop_last=False)) == [[10]]


@pytest.mark.parametrize("dp_before,dp_after", [(1, 1), (1, 4), (4, 2), (2, 1)])
def test_resume_continues_with_the_next_samples_at_another_dp_size(dp_before, dp_after):
    global_batch, total = 8, 200
    uninterrupted = _global_steps(total, 0, global_batch // dp_before, dp_before, 12)
    consumed = 5 * global_batch  # checkpoint after 5 steps
    resumed = _global_steps(total, consumed, global_batch // dp_after, dp_after, 7)
    assert resumed == uninterrupted[5:]
    assert [i for step in uninterrupted for i in step] == list(range(12 * global_batch))


def test_bad_sampler_input():
    with pytest.raises(ValueError, match="no samples left to consume: 10 consumed of 10"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="bad sampler layout"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)


def test_cyclic_sampler_resumes_and_covers_each_epoch():
    total, mbs, dp = 24, 2, 2
    # One pass of the sampler is one epoch: 6 steps of mbs x dp = 4 samples.
    steps = [list(MegatronPretrainingRandomSampler(None, total, 0, mbs, r, dp, data_sharding=True))
             for r in range(dp)]
    assert [len(s) for s in steps] == [6, 6]
    assert sorted(i for r in range(dp) for step in steps[r] for i in step) == list(range(total))
    consumed = 4 * mbs * dp
    resumed = [list(MegatronPretrainingRandomSampler(None, total, consumed, mbs, r, dp, True))[:2] for r in range(dp)]
    assert resumed == [steps[r][4:6] for r in range(dp)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader")
    tokenizer = NullTokenizer(64)
    ref.write(str(path / "d"), ref.corpus(3, 30, 64, tokenizer.eod))
    config = GPTDatasetConfig(random_seed=5, sequence_length=8, blend=([str(path / "d")], None), split="1",
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(path / "cache"))
    return BlendedMegatronDatasetBuilder(GPTDataset, [40, 0, 0], lambda: True, config).build()[0]


def _loader_args(**kw):
    base = dict(micro_batch_size=2, dataloader_type="single", num_workers=0)
    base.update(kw)
    return SimpleNamespace(**base)


def test_loader_batches_and_resume(dataset):
    loader = build_pretraining_data_loader(dataset, 0, args=_loader_args())
    batches = [b for _, b in zip(range(6), loader)]
    assert batches[0]["tokens"].shape == (2, 8) and batches[0]["attention_mask"].shape == (2, 1, 8, 8)
    assert torch.equal(batches[1]["tokens"], torch.stack([dataset[2]["tokens"], dataset[3]["tokens"]]))
    resumed = build_pretraining_data_loader(dataset, 6, args=_loader_args(num_workers=1))
    for want, got in zip(batches[3:], resumed):
        assert torch.equal(want["tokens"], got["tokens"]) and torch.equal(want["labels"], got["labels"])
    assert build_pretraining_data_loader(None, 0, args=_loader_args()) is None
    with pytest.raises(ValueError, match="--dataloader-type bogus is not supported"):
        build_pretraining_data_loader(dataset, 0, args=_loader_args(dataloader_type="bogus"))


def _case_loader_at_dp2(prefix_samples, consumed):
    from megatron_fsdp import parallel_state

    dataset = prefix_samples
    parallel_state.initialize_model_parallel()
    loader = build_pretraining_data_loader(dataset, consumed, args=_loader_args(micro_batch_size=1))
    return [b["tokens"].tolist() for _, b in zip(range(3), loader)]


def test_loader_reads_the_data_parallel_layout(pools, dataset):
    """Two DP ranks resumed after 4 samples: each step they hold the next two samples together."""
    per_rank = pools(2).run(_case_loader_at_dp2, dataset, 4)
    for step in range(3):
        got = per_rank[0][step] + per_rank[1][step]
        want = [dataset[4 + 2 * step]["tokens"].tolist(), dataset[5 + 2 * step]["tokens"].tolist()]
        assert got == want
