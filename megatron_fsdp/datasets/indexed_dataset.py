"""Megatron's tokenized-corpus format: a `.bin` of raw token ids and an `.idx` that indexes it.

`.idx` layout (little endian), byte-identical to Megatron-Core's writer:

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version, always 1
    uint8     dtype code of the tokens (DType below)
    uint64    sequence count S
    uint64    document-index length D (number of documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence byte offsets into the .bin
    int64[D]  document index: the first sequence of each document, then S
    int8[S]   sequence modes, multimodal files only

A document is one or more sequences (several with `--split-sentences`).
"""

from __future__ import annotations

import os
import shutil
import struct
from enum import Enum
from typing import List, Optional, Tuple, Type, Union

import numpy
import torch

from megatron_fsdp.utils import reject_unsupported

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
_HEADER_BYTES = len(_INDEX_HEADER) + 8 + 1 + 8 + 8


class DType(Enum):
    """Token dtype codes stored in the `.idx` header."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Type[numpy.number]) -> int:
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[numpy.number]:
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Union[int, Type[numpy.number]]) -> int:
        if isinstance(key, int):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """uint16 below a vocabulary of 65500 ids, else int32 (Megatron's rule)."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    return path_prefix + ".bin"


class _IndexWriter:
    """Writes an `.idx` file (a context manager, as Megatron's)."""

    def __init__(self, idx_path: str, dtype: Type[numpy.number]) -> None:
        self.idx_path = idx_path
        self.dtype = dtype

    def __enter__(self) -> "_IndexWriter":
        self.idx_writer = open(self.idx_path, "wb")
        self.idx_writer.write(_INDEX_HEADER)
        self.idx_writer.write(struct.pack("<Q", _INDEX_VERSION))
        self.idx_writer.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.idx_writer.close()

    def write(self, sequence_lengths, sequence_modes, document_indices) -> None:
        lengths = numpy.asarray(sequence_lengths, dtype=numpy.int64)
        if lengths.size and (lengths.min() < 0 or lengths.max() > numpy.iinfo(numpy.int32).max):
            raise ValueError(f"{self.idx_path}: sequence lengths must fit int32, got range "
                             f"[{lengths.min()}, {lengths.max()}]")
        pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
        numpy.cumsum(lengths[:-1] * DType.size(self.dtype), out=pointers[1:])
        self.idx_writer.write(struct.pack("<Q", len(lengths)))
        self.idx_writer.write(struct.pack("<Q", len(document_indices)))
        self.idx_writer.write(lengths.astype(numpy.int32).tobytes(order="C"))
        self.idx_writer.write(pointers.tobytes(order="C"))
        self.idx_writer.write(numpy.asarray(document_indices, dtype=numpy.int64).tobytes(order="C"))
        if sequence_modes is not None:
            self.idx_writer.write(numpy.asarray(sequence_modes, dtype=numpy.int8).tobytes(order="C"))


class _IndexReader:
    """Memory-maps an `.idx` file; every malformed header is one clear error."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES or header[:9] != _INDEX_HEADER:
            raise ValueError(f"{idx_path} is not a Megatron .idx file: it must start with "
                             f"{_INDEX_HEADER!r}, found {header[:9]!r}")
        version = struct.unpack("<Q", header[9:17])[0]
        if version != _INDEX_VERSION:
            raise ValueError(f"{idx_path}: .idx version {version} is not supported (only {_INDEX_VERSION})")
        code = header[17]
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise ValueError(f"{idx_path}: unknown token dtype code {code} "
                             f"(known: {[(d.value, d.name) for d in DType]})") from None
        self.dtype_size = DType.size(self.dtype)
        self.sequence_count, self.document_count = struct.unpack("<QQ", header[18:34])
        expected = _HEADER_BYTES + self.sequence_count * (4 + 8 + (1 if multimodal else 0)) + self.document_count * 8
        if size < expected:
            raise ValueError(f"{idx_path} is truncated: {size} bytes, its header promises {expected} "
                             f"({self.sequence_count} sequences, {self.document_count} document-index entries)")

        self.bin_buffer_mmap = numpy.memmap(idx_path, mode="r", order="C")
        buffer = memoryview(self.bin_buffer_mmap)
        offset = _HEADER_BYTES
        self.sequence_lengths = numpy.frombuffer(buffer, dtype=numpy.int32, count=self.sequence_count,
                                                 offset=offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = numpy.frombuffer(buffer, dtype=numpy.int64, count=self.sequence_count,
                                                  offset=offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = numpy.frombuffer(buffer, dtype=numpy.int64, count=self.document_count,
                                                 offset=offset)
        offset += self.document_indices.nbytes
        self.sequence_modes = None
        if multimodal:
            self.sequence_modes = numpy.frombuffer(buffer, dtype=numpy.int8, count=self.sequence_count,
                                                   offset=offset)
        if self.document_count == 0 or self.document_indices[0] != 0 \
                or self.document_indices[-1] != self.sequence_count:
            raise ValueError(f"{idx_path}: the document index must start at 0 and end at the sequence count "
                             f"{self.sequence_count}, got "
                             f"{self.document_indices[:1].tolist()}...{self.document_indices[-1:].tolist()}")

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> Tuple[numpy.int64, numpy.int32, Optional[numpy.int8]]:
        return (self.sequence_pointers[idx], self.sequence_lengths[idx],
                self.sequence_modes[idx] if self.sequence_modes is not None else None)


class IndexedDataset(torch.utils.data.Dataset):
    """Reader of a `.bin/.idx` pair: `ds[i]` is sequence i, `ds.get(i, offset, length)` a slice of it."""

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True,
                 object_storage_config=None, s3_config=None, fast_cache_load: bool = False,
                 sequences_per_dataset: Optional[Tuple[int, int]] = None, dtype_code: Optional[int] = None) -> None:
        super().__init__()
        reject_unsupported("IndexedDataset", {
            "object_storage_config": (object_storage_config, None, "data must be on a local or mounted file system"),
            "s3_config": (s3_config, None, "data must be on a local or mounted file system"),
            "fast_cache_load": (fast_cache_load, False),
            "sequences_per_dataset": (sequences_per_dataset, None),
            "dtype_code": (dtype_code, None, "the dtype is read from the .idx header"),
        }, error=ValueError)
        self.initialize(path_prefix, multimodal, mmap)

    def initialize(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"dataset prefix {path_prefix!r}: missing {' and '.join(missing)} "
                                    "(a prefix names the .bin/.idx pair without the extension, e.g. "
                                    "my-corpus_text_document)")
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.index = _IndexReader(idx_path, multimodal)
        bin_size = os.path.getsize(bin_path)
        if len(self.index):
            last = len(self.index) - 1
            needed = int(self.index.sequence_pointers[last]) + int(self.index.sequence_lengths[last]) * \
                self.index.dtype_size
            if bin_size < needed:
                raise ValueError(f"{bin_path} is truncated: {bin_size} bytes, its .idx needs {needed}")
        self._bin_path = bin_path
        self._bin_mmap = numpy.memmap(bin_path, mode="r", order="C") if mmap and bin_size else None

    def __getstate__(self):
        return (self.path_prefix, self.multimodal, self.mmap)

    def __setstate__(self, state) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def _read(self, count: int, offset: int) -> numpy.ndarray:
        if count == 0:
            return numpy.empty(0, dtype=self.index.dtype)
        if self._bin_mmap is not None:
            return numpy.frombuffer(self._bin_mmap, dtype=self.index.dtype, count=count, offset=offset)
        out = numpy.empty(count, dtype=self.index.dtype)
        with open(self._bin_path, "rb", buffering=0) as f:
            f.seek(offset)
            f.readinto(out)
        return out

    def __getitem__(self, idx):
        if isinstance(idx, (int, numpy.integer)):
            pointer, length, mode = self.index[idx]
            sequence = self._read(int(length), int(pointer))
            return (sequence, mode) if mode is not None else sequence
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("slices into an IndexedDataset must be contiguous (step 1)")
            lengths = self.index.sequence_lengths[idx]
            if len(lengths) == 0:
                return []
            flat = self._read(int(lengths.sum()), int(self.index.sequence_pointers[start]))
            sequences = numpy.split(flat, numpy.cumsum(lengths)[:-1])
            if self.multimodal:
                return sequences, self.index.sequence_modes[idx]
            return sequences
        raise TypeError(f"IndexedDataset index must be an int or a slice, got {type(idx).__name__}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None):
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when `length` is None)."""
        pointer, seq_length, mode = self.index[idx]
        if length is None:
            length = int(seq_length) - offset
        sequence = self._read(int(length), int(pointer) + offset * self.index.dtype_size)
        return (sequence, mode) if mode is not None else sequence

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    def get_document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    def set_document_indices(self, document_indices: numpy.ndarray) -> None:
        self.index.document_indices = document_indices

    @property
    def sequence_modes(self) -> numpy.ndarray:
        if self.index.sequence_modes is None:
            raise AttributeError(f"{self.path_prefix} was opened with multimodal=False: no sequence modes")
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writer: `add_item` (one sequence), `end_document`, `add_document`, `add_index`, `finalize`."""

    def __init__(self, bin_path: str, dtype: Type[numpy.number] = numpy.int32, multimodal: bool = False) -> None:
        DType.code_from_dtype(dtype)  # a dtype the format cannot name fails here, not at finalize
        self.data_file = open(bin_path, "wb")
        self.dtype = dtype
        self.multimodal = multimodal
        self.sequence_lengths: List[int] = []
        self.document_indices: List[int] = [0]
        self.sequence_modes: Optional[List[int]] = [] if multimodal else None

    def _as_array(self, tokens) -> numpy.ndarray:
        array = tokens.numpy() if isinstance(tokens, torch.Tensor) else numpy.asarray(tokens)
        out = numpy.asarray(array, dtype=self.dtype).reshape(-1)
        if array.size and numpy.issubdtype(numpy.dtype(self.dtype), numpy.integer):
            info = numpy.iinfo(self.dtype)
            low, high = array.min(), array.max()
            if low < info.min or high > info.max:
                raise ValueError(f"token ids [{low}, {high}] do not fit the file's dtype "
                                 f"{numpy.dtype(self.dtype).name}: use a wider dtype")
        return out

    def add_item(self, tensor, mode: int = 0) -> None:
        array = self._as_array(tensor)
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, tensor, lengths: List[int], modes: Optional[List[int]] = None) -> None:
        array = self._as_array(tensor)
        if sum(lengths) != array.size:
            raise ValueError(f"add_document: the lengths {list(lengths)} sum to {sum(lengths)}, "
                             f"the document has {array.size} tokens")
        self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append a whole `.bin/.idx` pair (partition merging)."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        if index.dtype != self.dtype:
            raise ValueError(f"add_index: {path_prefix} holds {numpy.dtype(index.dtype).name} tokens, "
                             f"this builder writes {numpy.dtype(self.dtype).name}")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(index.sequence_lengths.tolist())
        self.document_indices.extend((offset + index.document_indices[1:]).tolist())
        if self.multimodal:
            self.sequence_modes.extend(index.sequence_modes.tolist())
        del index
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file)

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        with _IndexWriter(idx_path, self.dtype) as writer:
            writer.write(self.sequence_lengths, self.sequence_modes, self.document_indices)
