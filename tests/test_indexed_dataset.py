"""Megatron's .bin/.idx format: golden bytes, round trips for every dtype, merging, bad files."""

import pickle
import struct

import numpy as np
import pytest
import torch

from megatron_fsdp.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

# Written by Megatron-Core 0.19.2's IndexedDatasetBuilder (megatron/core/datasets/indexed_dataset.py,
# run once under Python 3.11 with this repository's torch) for the documents of _write_golden:
# doc 0 = sequences [5, 7, 9] and [11]; doc 1 = [300, 2]; doc 2 = [42, 43, 44, 45] (add_document).
GOLDEN = {
    "uint16": (
        "4d4d4944494458000001000000000000000804000000000000000400000000000000030000000100000002000000"
        "040000000000000000000000060000000000000008000000000000000c0000000000000000000000000000000200"
        "00000000000003000000000000000400000000000000",
        "0500070009000b002c0102002a002b002c002d00",
    ),
    "int32": (
        "4d4d4944494458000001000000000000000404000000000000000400000000000000030000000100000002000000"
        "0400000000000000000000000c000000000000001000000000000000180000000000000000000000000000000200"
        "00000000000003000000000000000400000000000000",
        "0500000007000000090000000b0000002c010000020000002a0000002b0000002c0000002d000000",
    ),
}


def _write_golden(prefix, dtype):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    b.add_item(torch.tensor([5, 7, 9]))
    b.add_item(torch.tensor([11]))
    b.end_document()
    b.add_item(torch.tensor([300, 2]))
    b.end_document()
    b.add_document(torch.tensor([42, 43, 44, 45]), [4])
    b.finalize(prefix + ".idx")


def _expected_idx(code, lengths, itemsize, doc_index):
    """The layout written out field by field, independently of the writer."""
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    pointer = 0
    for n in lengths:
        out += struct.pack("<q", pointer)
        pointer += n * itemsize
    return out + b"".join(struct.pack("<q", d) for d in doc_index)


@pytest.mark.parametrize("dtype,code,itemsize", [(np.uint16, 8, 2), (np.int32, 4, 4)])
def test_golden_bytes_match_megatron_writer(tmp_path, dtype, code, itemsize):
    prefix = str(tmp_path / "g")
    _write_golden(prefix, dtype)
    idx = (tmp_path / "g.idx").read_bytes()
    assert idx == _expected_idx(code, [3, 1, 2, 4], itemsize, [0, 2, 3, 4])
    golden_idx, golden_bin = GOLDEN[np.dtype(dtype).name]
    assert idx.hex() == golden_idx
    assert (tmp_path / "g.bin").read_bytes().hex() == golden_bin


@pytest.mark.parametrize("name", ["uint16", "int32"])
def test_reads_megatron_written_files(tmp_path, name):
    golden_idx, golden_bin = GOLDEN[name]
    (tmp_path / "m.idx").write_bytes(bytes.fromhex(golden_idx))
    (tmp_path / "m.bin").write_bytes(bytes.fromhex(golden_bin))
    ds = IndexedDataset(str(tmp_path / "m"))
    assert ds.index.dtype == getattr(np, name)
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 7, 9], [11], [300, 2], [42, 43, 44, 45]]
    assert ds.document_indices.tolist() == [0, 2, 3, 4]
    assert ds.sequence_lengths.tolist() == [3, 1, 2, 4]
    assert ds.get(3, offset=1, length=2).tolist() == [43, 44]
    assert ds.get(0, offset=1).tolist() == [7, 9]
    assert [s.tolist() for s in ds[1:3]] == [[11], [300, 2]]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32,
                                   np.uint16])
@pytest.mark.parametrize("mmap", [True, False])
def test_round_trip_every_dtype(tmp_path, dtype, mmap):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    low, high = (0, 100) if info is None else (max(info.min, -1000), min(info.max, 1000))
    docs = [[rng.integers(low, high, size=rng.integers(0, 9)) for _ in range(rng.integers(1, 4))] for _ in range(20)]
    prefix = str(tmp_path / "d")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(torch.from_numpy(seq.astype(np.int64)))
        b.end_document()
    b.finalize(prefix + ".idx")
    assert (tmp_path / "d.idx").read_bytes()[17] == DType.code_from_dtype(dtype)
    ds = IndexedDataset(prefix, mmap=mmap)
    flat = [seq for doc in docs for seq in doc]
    assert len(ds) == len(flat)
    for got, want in zip((ds[i] for i in range(len(ds))), flat):
        assert got.dtype == dtype and got.tolist() == want.astype(dtype).tolist()
    expected_doc_index = np.cumsum([0] + [len(doc) for doc in docs]).tolist()
    assert ds.document_indices.tolist() == expected_doc_index


def test_add_index_merges_partitions_byte_for_byte(tmp_path):
    rng = np.random.default_rng(1)
    docs = [[rng.integers(0, 500, size=rng.integers(1, 7)) for _ in range(rng.integers(1, 3))] for _ in range(12)]

    def write(prefix, subset):
        b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for doc in subset:
            b.add_document(np.concatenate(doc), [len(s) for s in doc])
        b.finalize(prefix + ".idx")

    write(str(tmp_path / "whole"), docs)
    write(str(tmp_path / "p0"), docs[:5])
    write(str(tmp_path / "p1"), docs[5:])
    merged = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16)
    merged.add_index(str(tmp_path / "p0"))
    merged.add_index(str(tmp_path / "p1"))
    merged.finalize(str(tmp_path / "merged.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"whole.{ext}").read_bytes()
    wrong = IndexedDatasetBuilder(str(tmp_path / "w.bin"), dtype=np.int32)
    with pytest.raises(ValueError, match="uint16 tokens, this builder writes int32"):
        wrong.add_index(str(tmp_path / "p0"))


def test_multimodal_modes_round_trip(tmp_path):
    prefix = str(tmp_path / "mm")
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32, multimodal=True)
    b.add_item(torch.tensor([1, 2]), mode=0)
    b.add_item(torch.tensor([3]), mode=1)
    b.end_document()
    b.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix, multimodal=True)
    seq, mode = ds[1]
    assert seq.tolist() == [3] and mode == 1
    assert ds.sequence_modes.tolist() == [0, 1]


def test_pickles_for_dataloader_workers(tmp_path):
    prefix = str(tmp_path / "g")
    _write_golden(prefix, np.uint16)
    ds = pickle.loads(pickle.dumps(IndexedDataset(prefix)))
    assert ds[2].tolist() == [300, 2]


def test_token_out_of_dtype_range_is_refused(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="do not fit the file's dtype uint16"):
        b.add_item(torch.tensor([70000]))


def test_optimal_dtype_follows_megatron():
    assert DType.optimal_dtype(50257) == np.uint16
    assert DType.optimal_dtype(65499) == np.uint16
    assert DType.optimal_dtype(65500) == np.int32
    assert DType.optimal_dtype(None) == np.int32


def _corrupt(tmp_path, offset, payload):
    prefix = str(tmp_path / "g")
    _write_golden(prefix, np.uint16)
    data = bytearray((tmp_path / "g.idx").read_bytes())
    data[offset:offset + len(payload)] = payload
    (tmp_path / "g.idx").write_bytes(bytes(data))
    return prefix


def test_missing_prefix_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"dataset prefix .*nope.*missing .*nope.idx and .*nope.bin"):
        IndexedDataset(str(tmp_path / "nope"))


@pytest.mark.parametrize("offset,payload,match", [
    (0, b"NOTANIDX!", "is not a Megatron .idx file"),
    (9, struct.pack("<Q", 2), "version 2 is not supported"),
    (17, bytes([9]), "unknown token dtype code 9"),
    (18, struct.pack("<Q", 1000), "is truncated"),
])
def test_bad_idx_header_is_one_clear_error(tmp_path, offset, payload, match):
    with pytest.raises(ValueError, match=match):
        IndexedDataset(_corrupt(tmp_path, offset, payload))


def test_truncated_bin_is_one_clear_error(tmp_path):
    prefix = str(tmp_path / "g")
    _write_golden(prefix, np.uint16)
    data = (tmp_path / "g.bin").read_bytes()
    (tmp_path / "g.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match="g.bin is truncated"):
        IndexedDataset(prefix)
