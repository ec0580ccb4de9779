"""`BlendedMegatronDatasetConfig` and the `--split` parsing (Megatron-Core's fields and defaults)."""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from megatron_fsdp.datasets.utils import Split, check_weights, log_single_rank, normalize
from megatron_fsdp.utils import reject_unsupported

logger = logging.getLogger(__name__)


@dataclass
class BlendedMegatronDatasetConfig:
    """What to build: the blend (or one blend per split), the split, the cache directory."""

    random_seed: int
    sequence_length: int
    blend: Optional[Tuple[List[str], Optional[List[float]]]] = None
    blend_per_split: Optional[List[Optional[Tuple[List[str], Optional[List[float]]]]]] = None
    multiple_validation_sets: Optional[bool] = None
    full_validation: Optional[bool] = None
    split: Optional[str] = None
    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    num_dataset_builder_threads: int = 1
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = field(init=False, default=False)
    tokenizer: Optional[Any] = None
    mid_level_dataset_surplus: float = 0.005
    allow_ambiguous_pad_tokens: Optional[bool] = False
    fast_cache_load: bool = False
    defer_npy_index_mmap: bool = False

    def __post_init__(self) -> None:
        where = type(self).__name__
        reject_unsupported(where, {
            "fast_cache_load": (self.fast_cache_load, False, "indices are loaded from --data-cache-path anyway"),
            "defer_npy_index_mmap": (self.defer_npy_index_mmap, False),
        }, error=ValueError)
        if self.sequence_length < 1:
            raise ValueError(f"{where}: sequence_length must be >= 1, got {self.sequence_length}")
        if self.num_dataset_builder_threads < 1:
            raise ValueError(f"{where}: num_dataset_builder_threads must be >= 1, "
                             f"got {self.num_dataset_builder_threads}")
        if self.mid_level_dataset_surplus < 0:
            raise ValueError(f"{where}: mid_level_dataset_surplus must be >= 0, got {self.mid_level_dataset_surplus}")
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None:
                raise ValueError(f"{where}: blend (--data-path) and blend_per_split "
                                 "(--train/valid/test-data-path) exclude each other")
            if self.split is not None:
                raise ValueError(f"{where}: split (--split {self.split}) applies to blend (--data-path) only, "
                                 "not to blend_per_split")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(f"{where}: blend_per_split must hold {len(Split)} blends (train, valid, test), "
                                 f"got {len(self.blend_per_split)}")
            for split in Split:
                blend = self.blend_per_split[split.value]
                if blend is None:
                    log_single_rank(logger, logging.INFO, f"blend not provided for {split.name} split")
                else:
                    _check_blend(blend, f"{where}: the {split.name} blend")
        else:
            if self.blend is not None:
                _check_blend(self.blend, f"{where}: blend")
                if self.split is None:
                    raise ValueError(f"{where}: split (--split, e.g. 969,30,1) must be given with blend")
            else:
                self.mock = True
                log_single_rank(logger, logging.INFO, "Let mock = True, as both blend and blend_per_split are None")
                self.split = "1,1,1"
            split_vector = parse_and_normalize_split(self.split)
            self.split_matrix = convert_split_vector_to_split_matrix(split_vector)
            log_single_rank(logger, logging.INFO, f"Let split_matrix = {self.split_matrix}")


def _check_blend(blend, where: str) -> None:
    prefixes, weights = blend
    if not prefixes:
        raise ValueError(f"{where} names no dataset prefix")
    if weights is not None:
        if len(weights) != len(prefixes):
            raise ValueError(f"{where}: {len(prefixes)} prefixes but {len(weights)} weights; "
                             "weights and prefixes must be equal in number")
        check_weights(weights, where)


# Shares are separated by commas (or slashes, or blanks, which Megatron's digit-picking regex also
# accepts); each share is a plain decimal number, so "1e2", "nan" and "inf" are refused.
_SPLIT_SEPARATOR = re.compile(r"\s*[,/]\s*|\s+")
_SPLIT_SHARE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
_SPLIT_ALLOWED = ("--split takes up to three non-negative numbers separated by commas (train, valid, test), "
                  "at least one of them positive, e.g. 969,30,1")


def parse_and_normalize_split(split: str) -> List[float]:
    """`"969,30,1"` -> `[0.969, 0.03, 0.001]`; missing trailing parts are 0.

    Stricter than Megatron-Core, whose `re.findall(r"[.0-9]+", split)` reads the digits out of
    any string: there `100,-5,5` became `100,5,5` and `1,,1` became `1,1,0`. Here a malformed
    split is a one-line ValueError naming the bad part."""
    shares = [_parse_split_share(part, split) for part in _split_parts(split)]
    if sum(shares) <= 0:
        raise ValueError(f"--split {split!r} gives every split a zero share; {_SPLIT_ALLOWED}")
    return normalize(shares + [0.0] * (len(Split) - len(shares)))


def _split_parts(split: str) -> List[str]:
    if not isinstance(split, str):
        raise ValueError(f"--split must be a string, got {type(split).__name__} {split!r}; {_SPLIT_ALLOWED}")
    if not split.strip():
        raise ValueError(f"--split {split!r} is empty; {_SPLIT_ALLOWED}")
    parts = _SPLIT_SEPARATOR.split(split.strip())
    if len(parts) > len(Split):
        raise ValueError(f"--split {split!r} has {len(parts)} parts; {_SPLIT_ALLOWED}")
    return parts


def _parse_split_share(part: str, split: str) -> float:
    if not part:  # "1,,1" or a trailing comma: which share was meant is unclear
        raise ValueError(f"--split {split!r} has an empty part; {_SPLIT_ALLOWED}")
    share = float(part) if _SPLIT_SHARE.fullmatch(part) else math.nan
    if not math.isfinite(share):
        raise ValueError(f"--split {split!r}: {part!r} is not a finite number; {_SPLIT_ALLOWED}")
    if share < 0:
        raise ValueError(f"--split {split!r}: {part!r} is negative; {_SPLIT_ALLOWED}")
    return share + 0.0  # "-0" is a zero share, not -0.0


def convert_split_vector_to_split_matrix(vector_a: List[float],
                                         vector_b: Optional[List[float]] = None) -> List[Optional[Tuple[float, float]]]:
    """Book-ends of each split: `[0.99, 0.01, 0.0]` -> `[(0, 0.99), (0.99, 1.0), None]`."""
    if vector_b is None:
        vector_b = vector_a
    expansion_a = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *vector_a])
    expansion_b = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *vector_b])
    matrix = []
    for (a0, a1), (b0, b1) in zip(zip(expansion_a[:-1], expansion_a[1:]), zip(expansion_b[:-1], expansion_b[1:])):
        if min(a1, b1) <= max(a0, b0):
            matrix.append(None)
        else:
            matrix.append((max(a0, b0), min(a1, b1)))
    return matrix
