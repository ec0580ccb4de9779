"""Blending: Megatron's greedy indices (golden values from its C++, and a plain re-statement),
the builder's per-dataset sizes and split handling, `--data-path` parsing, bad input."""

import json

import numpy as np
import pytest
import torch

import dataset_reference as ref
from megatron_fsdp.datasets.blended_dataset import BlendedDataset
from megatron_fsdp.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_fsdp.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_fsdp.datasets.helpers import build_blending_indices, build_exhaustive_blending_indices
from megatron_fsdp.datasets.utils import get_blend_and_blend_per_split, get_blend_from_list, normalize
from megatron_fsdp.training.tokenizer.null_tokenizer import NullTokenizer

TOKENIZER = NullTokenizer(128)
EOD = TOKENIZER.eod

# From Megatron-Core 0.19.2's helpers.cpp (build_blending_indices / build_exhaustive_blending_indices),
# compiled by hand with g++ and run once on these inputs: (weights, size, dataset_index, dataset_sample_index).
GOLDEN = [
    ([0.3, 0.7], 20, [1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1],
     [0, 0, 1, 2, 1, 3, 4, 2, 5, 6, 3, 7, 8, 9, 4, 10, 11, 5, 12, 13]),
    ([1, 1, 1], 12, [0, 1, 2] * 4, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]),
    ([0.1, 0.2, 0.3, 0.25, 0.15], 30,
     [2, 3, 1, 4, 0, 2, 3, 1, 2, 4, 3, 2, 1, 0, 3, 2, 4, 1, 3, 2, 0, 2, 3, 1, 4, 2, 3, 1, 2, 4],
     [0, 0, 0, 0, 0, 1, 1, 1, 2, 1, 2, 3, 2, 1, 3, 4, 2, 3, 4, 5, 2, 6, 5, 4, 3, 7, 6, 5, 8, 4]),
    ([30, 70], 25, [1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0],
     [0, 0, 1, 2, 1, 3, 4, 2, 5, 6, 3, 7, 8, 9, 4, 10, 11, 5, 12, 13, 6, 14, 15, 16, 7]),
]
GOLDEN_EXHAUSTIVE = [
    ([3, 5, 2], [1, 0, 2, 1, 0, 1, 2, 1, 0, 1], [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]),
    ([1, 4], [1, 0, 1, 1, 1], [0, 0, 1, 2, 3]),
]


def _greedy(weights, size):
    """helpers.cpp build_blending_indices, read line by line."""
    counts = [0] * len(weights)
    picks, samples = [], []
    for s in range(size):
        x = max(float(s), 1.0)
        best, best_error = 0, weights[0] * x - counts[0]
        for i in range(1, len(weights)):
            error = weights[i] * x - counts[i]
            if error > best_error:
                best, best_error = i, error
        picks.append(best)
        samples.append(counts[best])
        counts[best] += 1
    return picks, samples


def _run(weights, size):
    a, b = np.zeros(size, np.int16), np.zeros(size, np.int64)
    build_blending_indices(a, b, normalize(weights), len(weights), size)
    return a.tolist(), b.tolist()


@pytest.mark.parametrize("weights,size,index,sample", GOLDEN)
def test_blending_indices_equal_megatrons(weights, size, index, sample):
    assert _run(weights, size) == (index, sample)


@pytest.mark.parametrize("sizes,index,sample", GOLDEN_EXHAUSTIVE)
def test_exhaustive_blending_indices_equal_megatrons(sizes, index, sample):
    a, b = np.zeros(sum(sizes), np.int16), np.zeros(sum(sizes), np.int64)
    build_exhaustive_blending_indices(a, b, sizes, len(sizes))
    assert (a.tolist(), b.tolist()) == (index, sample)


@pytest.mark.parametrize("seed", range(12))
def test_blending_indices_equal_the_greedy_loop(seed):
    """Random weights, exact ties (equal and rational weights) and long runs: the fast paths must
    reproduce the loop's floating-point decisions exactly."""
    rng = np.random.default_rng(seed)
    choices = [rng.random(int(rng.integers(1, 9))).tolist(), [1.0] * int(rng.integers(2, 6)), [0.3, 0.7],
               [0.25, 0.25, 0.5], [1, 2]]
    weights = normalize(choices[seed % len(choices)])
    size = int(rng.integers(1, 30000))
    assert _run(weights, size) == _greedy(weights, size)


def _corpus(tmp_path, name, num_docs, seed):
    prefix = str(tmp_path / name)
    docs = ref.corpus(seed, num_docs, 128, EOD)
    ref.write(prefix, docs)
    return prefix


def _config(**kw):
    base = dict(random_seed=11, sequence_length=8, tokenizer=TOKENIZER, reset_position_ids=False,
                reset_attention_mask=False, eod_mask_loss=False)
    base.update(kw)
    return GPTDatasetConfig(**base)


def test_weighted_blend_through_the_builder(tmp_path):
    a, b = _corpus(tmp_path, "a", 60, 1), _corpus(tmp_path, "b", 40, 2)
    sizes = [100, 20, 4]
    config = _config(blend=([a, b], [30.0, 70.0]), split="90,8,2", path_to_cache=str(tmp_path / "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    for dataset, requested in ((train, 100), (valid, 20), (test, 4)):
        size = int(np.ceil(requested * 0.3) + np.ceil(requested * 0.7))  # 4 -> 2 + 3 = 5, as Megatron
        assert isinstance(dataset, BlendedDataset) and len(dataset) == size
        # Each mid-level dataset is asked for ceil(ceil(size * weight) * 1.005) samples.
        assert [d.num_samples for d in dataset.datasets] == [int(np.ceil(np.ceil(requested * w) * 1.005))
                                                             for w in (0.3, 0.7)]
        picks, samples = _greedy([0.3, 0.7], size)
        assert dataset.dataset_index.tolist() == picks and dataset.dataset_sample_index.tolist() == samples
        for i in (0, size - 1):
            got = dataset[i]
            want = dataset.datasets[picks[i]][samples[i]]
            assert got["dataset_id"] == picks[i] and torch.equal(got["tokens"], want["tokens"])


def test_unweighted_blend_and_per_split_paths(tmp_path):
    a, b, c = _corpus(tmp_path, "a", 30, 3), _corpus(tmp_path, "b", 20, 4), _corpus(tmp_path, "c", 25, 5)
    config = _config(blend=([a, b], None), split="80,20,0", path_to_cache=str(tmp_path / "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()
    # No weights, no size: every sample of every dataset exactly once, by the exhaustive greedy.
    assert len(train) == sum(len(d) for d in train.datasets) and test is None
    assert sorted(zip(train.dataset_index.tolist(), train.dataset_sample_index.tolist())) == \
        sorted((i, s) for i, d in enumerate(train.datasets) for s in range(len(d)))

    per_split = [([a, c], [1.0, 3.0]), ([b], None), None]
    config = _config(blend_per_split=per_split, path_to_cache=str(tmp_path / "cache"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, 10, 0], lambda: True, config).build()
    assert len(train) == 40 and [d.dataset_path for d in train.datasets] == [a, c]
    assert isinstance(valid, GPTDataset) and valid.dataset_path == b and test is None
    assert valid.indices.tolist() == list(range(len(valid.dataset.sequence_lengths)))  # the whole file


def test_blend_parsing(tmp_path):
    assert get_blend_from_list(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    assert get_blend_from_list(["a"]) == (["a"], None)
    # Odd length: all prefixes (Megatron's rule); "0.3" then fails as a missing prefix.
    assert get_blend_from_list(["0.3", "a", "b"]) == (["0.3", "a", "b"], None)
    assert get_blend_from_list(None) is None
    with pytest.raises(ValueError, match="finite number > 0"):
        get_blend_from_list(["0", "a", "1", "b"])
    with pytest.raises(ValueError, match="finite number > 0"):
        get_blend_from_list(["-1", "a", "2", "b"])

    class Args:
        data_path = None
        data_args_path = None
        train_data_path = valid_data_path = test_data_path = None
        per_split_data_args_path = None

    args = Args()
    args.data_path = ["30", "x", "70", "y"]
    assert get_blend_and_blend_per_split(args) == ((["x", "y"], [30.0, 70.0]), None)
    args.data_path = None
    (tmp_path / "per_split.json").write_text(json.dumps({"train": "1 x 3 y", "valid": ["z"], "test": None}))
    args.per_split_data_args_path = str(tmp_path / "per_split.json")
    assert get_blend_and_blend_per_split(args) == (None, [(["x", "y"], [1.0, 3.0]), (["z"], None), None])
    args.data_path = ["x"]
    with pytest.raises(ValueError, match="exclude each other"):
        get_blend_and_blend_per_split(args)


def test_weights_without_a_size_are_refused(tmp_path):
    a, b = _corpus(tmp_path, "a", 10, 6), _corpus(tmp_path, "b", 10, 7)
    with pytest.raises(ValueError, match="weights but no sample count"):
        BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True,
                                      _config(blend=([a, b], [0.5, 0.5]), split="1"))


def test_odd_length_data_path_reports_the_missing_prefix(tmp_path):
    a = _corpus(tmp_path, "a", 10, 8)
    blend = get_blend_from_list(["0.5", a, a])
    with pytest.raises(FileNotFoundError, match=r"dataset prefix '0.5'"):
        BlendedMegatronDatasetBuilder(GPTDataset, [4, 0, 0], lambda: True, _config(blend=blend, split="1")).build()
