"""`check_token_ids_within_vocab`: refuse data whose token ids the model's vocabulary cannot embed.

A corpus tokenized with another tokenizer (or a NullTokenizer corpus with a too small
`--vocab-size`) would otherwise fail deep inside the embedding, on one rank, mid-training. The
trainer calls this after building the datasets, on every rank, before the first step: each rank
reads the same files, so every rank raises the same error without any communication.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, Iterable, Optional, Tuple

import numpy

from megatron_fsdp.datasets.blended_dataset import BlendedDataset
from megatron_fsdp.datasets.indexed_dataset import IndexedDataset, get_bin_path

_CHUNK_TOKENS = 1 << 24
_scanned: Dict[tuple, Tuple[int, int]] = {}


def _low_level_datasets(datasets: Iterable) -> Dict[str, IndexedDataset]:
    found: Dict[str, IndexedDataset] = {}
    stack = list(datasets)
    while stack:
        item = stack.pop()
        if item is None:
            continue
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, BlendedDataset):
            stack.extend(item.datasets)
        elif isinstance(getattr(item, "dataset", None), IndexedDataset):
            found[item.dataset.path_prefix] = item.dataset
        elif isinstance(item, IndexedDataset):
            found[item.path_prefix] = item
    return found


def token_id_range(dataset: IndexedDataset, path_to_cache: Optional[str] = None) -> Tuple[int, int]:
    """`(smallest, largest)` token id in the `.bin` ((0, -1) when empty); remembered per file and in path_to_cache."""
    bin_path = get_bin_path(dataset.path_prefix)
    stat = os.stat(bin_path)
    key = (os.path.abspath(bin_path), stat.st_size, stat.st_mtime_ns)
    if key in _scanned:
        return _scanned[key]
    memo = None
    if path_to_cache:
        digest = hashlib.md5(repr(key).encode(), usedforsecurity=False).hexdigest()
        memo = os.path.join(path_to_cache, f"{digest}-max_token_id.txt")
        if os.path.isfile(memo):
            with open(memo) as f:
                low, high = (int(x) for x in f.read().split())
            _scanned[key] = (low, high)
            return low, high
    tokens = numpy.memmap(bin_path, dtype=dataset.index.dtype, mode="r") if stat.st_size else numpy.empty(0)
    low, high = 0, -1
    for start in range(0, len(tokens), _CHUNK_TOKENS):
        chunk = tokens[start:start + _CHUNK_TOKENS]
        low = int(chunk.min()) if start == 0 else min(low, int(chunk.min()))
        high = max(high, int(chunk.max()))
    result = (low, high)
    del tokens
    _scanned[key] = result
    if memo:
        os.makedirs(path_to_cache, exist_ok=True)
        tmp = f"{memo}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{low} {high}")
        os.replace(tmp, memo)
    return result


def check_token_ids_within_vocab(datasets: Iterable, vocab_size: int, path_to_cache: Optional[str] = None) -> None:
    """Raise ValueError naming the file when a token id of the datasets' files is outside [0, vocab_size).

    `datasets`: what BlendedMegatronDatasetBuilder.build() returned (None entries are skipped).
    A `.bin` is scanned once (about 1 GB/s); the result is kept per process and, with
    `path_to_cache`, in a small file there.
    """
    for prefix, dataset in sorted(_low_level_datasets(datasets).items()):
        dtype = numpy.dtype(dataset.index.dtype)
        if dtype.kind == "u" and numpy.iinfo(dtype).max < vocab_size:
            continue  # every value the file can hold is a valid id
        smallest, largest = token_id_range(dataset, path_to_cache)
        if smallest < 0 or largest >= vocab_size:
            bad = smallest if smallest < 0 else largest
            raise ValueError(f"{get_bin_path(prefix)} holds token id {bad}, but the tokenizer's vocabulary has "
                             f"{vocab_size} ids (0..{vocab_size - 1}): was the data tokenized with another "
                             "tokenizer or a larger --vocab-size?")
