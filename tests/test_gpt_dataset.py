"""GPTDataset samples equal an independent re-statement of Megatron's algorithm (tests/dataset_reference.py),
and golden values recorded from Megatron-Core 0.19.2 itself; splits, the last-epoch rule, caches, errors."""

import os

import numpy as np
import pytest
import torch

import dataset_reference as ref
from megatron_fsdp.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron_fsdp.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron_fsdp.datasets.indexed_dataset import IndexedDataset
from megatron_fsdp.datasets.utils import Split
from megatron_fsdp.datasets.vocab_check import check_token_ids_within_vocab
from megatron_fsdp.training.tokenizer.null_tokenizer import NullTokenizer

VOCAB = 128
TOKENIZER = NullTokenizer(VOCAB)
EOD = TOKENIZER.eod


def _config(**kw):
    base = dict(random_seed=1234, sequence_length=16, tokenizer=TOKENIZER, reset_position_ids=False,
                reset_attention_mask=False, eod_mask_loss=False, split="1")
    base.update(kw)
    return GPTDatasetConfig(**base)


def _assert_samples_equal(dataset, expected, create_attention_mask=True):
    assert len(dataset) == len(expected)
    for i, want in enumerate(expected):
        got = dataset[i]
        keys = ["tokens", "labels", "loss_mask", "position_ids"] + (["attention_mask"] if create_attention_mask else [])
        assert sorted(got) == sorted(keys), got.keys()
        for k in keys:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (i, k, got[k], want[k])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus")
    docs = ref.corpus(0, 40, VOCAB, EOD)
    ref.write(str(path / "c"), docs)
    return str(path / "c"), [seq for doc in docs for seq in doc]


@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True), (True, False, False)])
@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("num_samples,seq_length", [(None, 16), (30, 7), (120, 16), (91, 10)])
def test_samples_match_the_reference(tmp_path, corpus, flags, extra, num_samples, seq_length):
    prefix, sequences = corpus
    config = _config(sequence_length=seq_length, reset_position_ids=flags[0], reset_attention_mask=flags[1],
                     eod_mask_loss=flags[2], add_extra_token_to_sequence=extra, path_to_cache=str(tmp_path),
                     random_seed=7)
    indices = np.arange(3, len(sequences) - 2, dtype=np.int32)
    ds = GPTDataset(IndexedDataset(prefix), prefix, indices, num_samples, Split.train, config)
    expected = ref.gpt_samples(sequences, indices, num_samples, seq_length, 7, EOD, reset_position_ids=flags[0],
                               reset_attention_mask=flags[1], eod_mask_loss=flags[2], extra=extra)
    _assert_samples_equal(ds, expected)
    if num_samples is not None:
        assert len(ds) >= num_samples


@pytest.mark.parametrize("drop_last", [True, False])
def test_validation_partial_last_sample_is_padded_and_masked(tmp_path, corpus, drop_last):
    prefix, sequences = corpus
    config = _config(sequence_length=13, drop_last_partial_validation_sequence=drop_last, path_to_cache=str(tmp_path))
    indices = np.arange(len(sequences), dtype=np.int32)
    ds = GPTDataset(IndexedDataset(prefix), prefix, indices, None, Split.valid, config)
    expected = ref.gpt_samples(sequences, indices, None, 13, 1234, EOD, drop_last=drop_last)
    _assert_samples_equal(ds, expected)
    total = sum(len(s) for s in sequences)
    assert len(ds) == ((total - 1) // 13 if drop_last else -(-(total - 1) // 13))


def test_last_epoch_rule(tmp_path, corpus):
    """Fewer than 80% of an epoch's samples from the last epoch: that epoch is shuffled apart."""
    prefix, sequences = corpus
    indices = np.arange(len(sequences), dtype=np.int32)
    tokens = sum(len(s) for s in sequences)
    per_epoch = (tokens - 1) // 16
    for fraction, separate in ((0.5, True), (0.95, False)):
        sans_final = (tokens - 1) // 16  # one full epoch before the last
        num_samples = sans_final + int(fraction * per_epoch)
        ds = GPTDataset(IndexedDataset(prefix), prefix, indices, num_samples, Split.train,
                        _config(path_to_cache=str(tmp_path / str(fraction))))
        doc_index = np.asarray(ds.document_index)
        second_epoch = doc_index[len(indices):]
        # Separated: the last epoch is a permutation of the split on its own. Together: both
        # epochs were shuffled as one, so the second half is (almost surely) not a permutation.
        assert (sorted(second_epoch.tolist()) == indices.tolist()) == separate
        shuffle = np.asarray(ds.shuffle_index)
        if separate:
            assert sorted(shuffle[:sans_final].tolist()) == list(range(sans_final))
            assert sorted(shuffle[sans_final:].tolist()) == list(range(sans_final, len(ds)))
        _assert_samples_equal(ds, ref.gpt_samples(sequences, indices, num_samples, 16, 1234, EOD))


def test_reset_flags_and_eod_mask_on_a_known_sample(tmp_path):
    prefix = str(tmp_path / "k")
    ref.write(prefix, [[[1, 2, EOD, 3, 4, 5, EOD, 6, 7]]])
    cfg = _config(sequence_length=8, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
                  path_to_cache=str(tmp_path))
    sample = GPTDataset(IndexedDataset(prefix), prefix, np.arange(1, dtype=np.int32), None, Split.train, cfg)[0]
    assert sample["tokens"].tolist() == [1, 2, EOD, 3, 4, 5, EOD, 6]
    assert sample["labels"].tolist() == [2, EOD, 3, 4, 5, EOD, 6, 7]
    assert sample["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert sample["loss_mask"].tolist() == [1, 1, 0, 1, 1, 1, 0, 1]
    document = [0, 0, 0, 1, 1, 1, 1, 2]
    allowed = torch.tensor([[k <= q and document[k] == document[q] for k in range(8)] for q in range(8)])
    assert torch.equal(sample["attention_mask"][0], ~allowed)


def test_without_attention_mask(tmp_path, corpus):
    prefix, sequences = corpus
    ds = GPTDataset(IndexedDataset(prefix), prefix, np.arange(len(sequences), dtype=np.int32), None, Split.train,
                    _config(create_attention_mask=False, path_to_cache=str(tmp_path)))
    _assert_samples_equal(ds, ref.gpt_samples(sequences, range(len(sequences)), None, 16, 1234, EOD),
                          create_attention_mask=False)


def test_split_boundaries(tmp_path):
    prefix = str(tmp_path / "s")
    ref.write(prefix, [[[i % 100 + 1, EOD]] for i in range(1000)])
    config = _config(blend=([prefix], None), split="969,30,1", sequence_length=2, path_to_cache=str(tmp_path))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()
    assert (train.indices[0], train.indices[-1]) == (0, 968)
    assert (valid.indices[0], valid.indices[-1]) == (969, 998)
    assert test.indices.tolist() == [999]
    config = _config(blend=([prefix], None), split="98,2", sequence_length=2, path_to_cache=str(tmp_path))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [10, 5, 0], lambda: True, config).build()
    assert len(train.indices) == 980 and len(valid.indices) == 20 and test is None


def test_cache_is_reused_and_keyed_on_the_data(tmp_path, corpus):
    prefix, sequences = corpus
    cache = tmp_path / "cache"
    indices = np.arange(len(sequences), dtype=np.int32)
    first = GPTDataset(IndexedDataset(prefix), prefix, indices, 50, Split.train, _config(path_to_cache=str(cache)))
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and all(f.startswith(first.unique_description_hash) for f in files)
    assert not isinstance(first.sample_index, np.memmap)
    again = GPTDataset(IndexedDataset(prefix), prefix, indices, 50, Split.train, _config(path_to_cache=str(cache)))
    assert isinstance(again.sample_index, np.memmap)  # read from the cache, not rebuilt
    assert sorted(os.listdir(cache)) == files
    for i in range(len(first)):
        assert torch.equal(first[i]["tokens"], again[i]["tokens"])
    # Other data at the same prefix gets its own cache entry.
    fewer = GPTDataset(IndexedDataset(prefix), prefix, indices[:-1], 50, Split.train, _config(path_to_cache=str(cache)))
    assert fewer.unique_description_hash != first.unique_description_hash
    # Megatron's default cache directory: <prefix>/cache/GPTDataset_indices
    d = GPTDataset(IndexedDataset(prefix), prefix, indices, 5, Split.train, _config(blend=([prefix], None)))
    assert os.path.isdir(os.path.join(prefix, "cache", "GPTDataset_indices")) and len(d) >= 5


def test_mock_dataset_through_the_builder():
    config = GPTDatasetConfig(random_seed=3, sequence_length=32, tokenizer=NullTokenizer(1000),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=True)
    train, valid, test = BlendedMegatronDatasetBuilder(MockGPTDataset, [20, 4, 4], lambda: True, config).build()
    assert len(train) >= 20 and len(valid) >= 4 and len(test) >= 4
    sample = train[0]
    # Mock sequences count 1, 2, 3, ... (mod vocab) and end with eod: next token = token + 1 inside a sequence.
    t, lab = sample["tokens"], sample["labels"]
    inside = (t != 999) & (lab != 999)
    assert torch.equal(lab[inside], (t[inside] + 1) % 1000)


def test_token_ids_beyond_the_vocabulary_are_one_clear_error(tmp_path, corpus):
    prefix, sequences = corpus
    ds = GPTDataset(IndexedDataset(prefix), prefix, np.arange(len(sequences), dtype=np.int32), None, Split.train,
                    _config(path_to_cache=str(tmp_path)))
    check_token_ids_within_vocab([ds, None, None], VOCAB, path_to_cache=str(tmp_path))
    largest = max(max(s) for s in sequences)
    with pytest.raises(ValueError, match=f"holds token id {largest}, but the tokenizer's vocabulary has {largest}"):
        check_token_ids_within_vocab([ds], largest, path_to_cache=str(tmp_path))


@pytest.mark.parametrize("kw,match", [
    (dict(tokenizer=None), "tokenizer is required"),
    (dict(eod_mask_loss=None), "eod_mask_loss must be set"),
    (dict(split="969,30,1", blend=None, blend_per_split=[(["a"], None), None, None]), "exclude each other|applies"),
    (dict(blend=(["a", "b"], [0.5])), "2 prefixes but 1 weights"),
    (dict(blend=(["a", "b"], [0.5, -1.0])), "finite number > 0"),
    (dict(blend=(["a"], None), split=None), "split .* must be given"),
    (dict(blend=(["a"], None), split="90-10"), "up to three non-negative numbers"),
    (dict(hybrid_context_parallel=True), "hybrid_context_parallel=True is not supported"),
    (dict(fast_cache_load=True), "fast_cache_load=True is not supported"),
])
def test_bad_config_is_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        _config(**kw)


@pytest.mark.parametrize("split,match", [
    ("100,-5,5", r"--split '100,-5,5': '-5' is negative; --split takes up to three non-negative numbers"),
    ("-1", r"'-1' is negative"),
    ("90,abc", r"'abc' is not a finite number"),
    ("1e2,1,1", r"'1e2' is not a finite number"),
    ("nan,1", r"'nan' is not a finite number"),
    ("1,,1", r"--split '1,,1' has an empty part"),
    ("969,30,", r"has an empty part"),
    ("", r"--split '' is empty"),
    ("0,0,0", r"gives every split a zero share; .*at least one of them positive"),
    ("0", r"gives every split a zero share"),
    ("1,2,3,4", r"has 4 parts"),
    ([90, 10], r"--split must be a string, got list"),
])
def test_malformed_split_is_one_line_naming_the_bad_value(split, match):
    """Megatron-Core reads the digits out of any string (100,-5,5 was 100,5,5): refused here."""
    with pytest.raises(ValueError, match=match) as error:
        _config(blend=(["a"], None), split=split)
    assert "\n" not in str(error.value) and "e.g. 969,30,1" in str(error.value)


@pytest.mark.parametrize("split,shares", [
    ("969,30,1", [0.969, 0.03, 0.001]), ("969, 30, 1", [0.969, 0.03, 0.001]), ("90/5/5", [0.9, 0.05, 0.05]),
    ("3 1", [0.75, 0.25, 0.0]), ("1", [1.0, 0.0, 0.0]), (".5,0.5,0", [0.5, 0.5, 0.0]), ("-0,1", [0.0, 1.0, 0.0]),
])
def test_well_formed_splits_parse_as_megatron(split, shares):
    from megatron_fsdp.datasets.blended_megatron_dataset_config import parse_and_normalize_split
    assert parse_and_normalize_split(split) == shares


def test_split_leaving_train_empty_fails_before_building(tmp_path):
    prefix = str(tmp_path / "tiny")
    ref.write(prefix, [[[1, 2, 3, EOD]] for _ in range(10)])
    config = _config(blend=([prefix], None), split="1,99,0", sequence_length=2, path_to_cache=str(tmp_path))
    with pytest.raises(ValueError, match=r"the train split of .*tiny is empty: 10 sequences"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 10, 0], lambda: True, config).build()
    missing = _config(blend=([str(tmp_path / "absent")], None), split="1", path_to_cache=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="absent.*missing"):
        BlendedMegatronDatasetBuilder(GPTDataset, [10, 0, 0], lambda: True, missing).build()


def _case_rank0_builds_the_cache(prefix, cache, shared):
    rank = torch.distributed.get_rank()
    config = _config(blend=([prefix], None), split="90,10,0", path_to_cache=cache if shared else f"{cache}/{rank}")
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [40, 8, 0], lambda: True, config).build()
    loaded = isinstance(train.sample_index, np.memmap)
    return loaded, [train[i]["tokens"].tolist() for i in range(len(train))] + [valid[0]["tokens"].tolist()]


@pytest.mark.parametrize("shared", [True, False])
def test_rank0_builds_the_cache_and_the_others_read_it(pools, corpus, tmp_path, shared):
    prefix, _ = corpus
    (loaded0, samples0), (loaded1, samples1) = pools(2).run(_case_rank0_builds_the_cache, prefix,
                                                            str(tmp_path), shared)
    assert samples0 == samples1
    assert not loaded0
    # Shared directory: rank 1 reads rank 0's files. Node-local ones: rank 1 builds the same indices itself.
    assert loaded1 == shared


def _case_bad_prefix(path):
    config = _config(blend=([path], None), split="1", path_to_cache=None)
    BlendedMegatronDatasetBuilder(GPTDataset, [4, 0, 0], lambda: True, config).build()


def test_bad_prefix_fails_on_every_rank_without_hanging(pools, tmp_path):
    errors = pools(2).run_expecting_errors(_case_bad_prefix, str(tmp_path / "absent"), timeout=60)
    assert all(e.type_name == "FileNotFoundError" and "absent" in e.message for e in errors)


def _case_rank0_only_failure(prefix, cache):
    # Rank 0 alone writes the index cache: a cache path that is a file fails there only.
    config = _config(blend=([prefix], None), split="90,10,0",
                     path_to_cache=cache if torch.distributed.get_rank() == 0 else None)
    BlendedMegatronDatasetBuilder(GPTDataset, [40, 8, 0], lambda: True, config).build()


def test_a_failure_on_rank0_alone_is_raised_on_every_rank(pools, corpus, tmp_path):
    prefix, _ = corpus
    not_a_directory = tmp_path / "cache"
    not_a_directory.write_text("a file where the cache directory should be")
    errors = pools(2).run_expecting_errors(_case_rank0_only_failure, prefix, str(not_a_directory), timeout=60)
    by_rank = {e.rank: e for e in errors}
    assert sorted(by_rank) == [0, 1]
    assert str(not_a_directory) in by_rank[0].message
    assert by_rank[1].type_name == "RuntimeError" and "failed on rank 0" in by_rank[1].message
    assert str(not_a_directory) in by_rank[1].message


def _digest(ds):
    acc = 0
    for i in range(len(ds)):
        s = ds[i]
        w = torch.arange(1, s["tokens"].numel() + 1)
        acc = (acc * 1000003 + int((s["tokens"] * w).sum()) * 7 + int((s["position_ids"] * w).sum()) * 3
               + int((s["loss_mask"] * w).sum()) + int(s.get("dataset_id", 0))) % (2**61 - 1)
    return acc


def test_golden_values_from_megatron(tmp_path):
    """Recorded by running Megatron-Core 0.19.2's own BlendedMegatronDatasetBuilder/GPTDataset/BlendedDataset
    (its helpers.cpp compiled by hand with g++, under Python 3.11 with this repository's torch) on these
    files, written by our IndexedDatasetBuilder; the same flags and seeds; _digest over every sample."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ref.write(a, ref.corpus(11, 50, VOCAB, EOD))
    ref.write(b, ref.corpus(12, 30, VOCAB, EOD), dtype=np.int32)
    config = _config(random_seed=4321, sequence_length=12, blend=([a, b], [0.4, 0.6]), split="90,8,2",
                     reset_position_ids=True, eod_mask_loss=True, path_to_cache=str(tmp_path / "c1"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [300, 40, 8], lambda: True, config).build()
    assert (len(train), _digest(train)) == (300, 2079441164467802496)
    assert (len(valid), _digest(valid)) == (40, 509603637923378844)
    assert (len(test), _digest(test)) == (9, 746491182425979454)
    assert train[0]["tokens"].tolist() == [82, 53, 39, 44, 14, 11, 127, 76, 14, 32, 63, 106]
    assert train[0]["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]
    assert train.dataset_index[:16].tolist() == [1, 0, 1, 0, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0, 1, 0]

    config = _config(random_seed=99, sequence_length=10, blend=([a], None), split="90,10,0",
                     add_extra_token_to_sequence=False, path_to_cache=str(tmp_path / "c2"))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [500, 20, 0], lambda: True, config).build()
    assert (len(train), _digest(train)) == (583, 1742359424937565812)
    assert (len(valid), _digest(valid)) == (24, 1359967851190992169)
    assert train[0]["tokens"].tolist() == [39, 68, 13, 45, 56, 92, 60, 100, 59, 25]
    assert valid[len(valid) - 1]["labels"].tolist() == [127, 84, 31, 73, 63, 65, 99, 79, 127, 0]


def test_sample_index_equals_the_walk_with_empty_documents(monkeypatch):
    from megatron_fsdp.datasets import helpers

    monkeypatch.setattr(helpers, "_SAMPLE_CHUNK", 5)  # several chunks even for small inputs
    rng = np.random.default_rng(0)
    for trial in range(200):
        sizes = rng.integers(0 if trial % 2 else 1, 20, size=int(rng.integers(2, 30))).astype(np.int32)
        epochs, seq = int(rng.integers(1, 4)), int(rng.integers(2, 12))
        tokens = int(sizes.sum())
        if tokens < seq + 2:
            continue
        docs = np.tile(np.arange(len(sizes)), epochs).astype(np.int32)
        rng.shuffle(docs)
        for drop_last in (True, False):
            for extra in (1, 0):
                want = ref.sample_index_walk(sizes.tolist(), docs, seq, epochs, tokens, drop_last, extra)
                got = helpers.build_sample_idx(sizes, docs, seq, epochs, tokens, drop_last, bool(extra))
                assert got.tolist() == want.tolist(), (trial, drop_last, extra)
