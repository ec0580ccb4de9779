"""Split names, weight normalization and `--data-path` parsing (Megatron-Core's `datasets.utils`)."""

from __future__ import annotations

import logging
import math
from enum import Enum
from typing import List, Optional, Tuple

import numpy

from megatron_fsdp.utils import get_rank_safe

logger = logging.getLogger(__name__)


class Split(Enum):
    train = 0
    valid = 1
    test = 2


def log_single_rank(log: logging.Logger, *args, rank: int = 0, **kwargs) -> None:
    """Log on one rank only (rank 0 by default; every process when torch.distributed is not up)."""
    if get_rank_safe() == rank:
        log.log(*args, **kwargs)


def normalize(weights: List[float]) -> List[float]:
    """Divide by the sum, in float64 with numpy's summation (Megatron's exact arithmetic)."""
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def check_weights(weights: List[float], where: str) -> None:
    """A clear error for weights Megatron would choke on later (zero, negative, nan, inf)."""
    bad = [w for w in weights if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0)]
    if bad:
        raise ValueError(f"{where}: every dataset weight must be a finite number > 0, got {bad} "
                         f"in {list(weights)} (weights are normalized to sum to 1, as Megatron does)")


def get_blend_from_list(
    blend: Optional[List[str]],
) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """`["30", "a", "70", "b"]` -> `(["a", "b"], [30.0, 70.0])`; `["a", "b"]` -> `(["a", "b"], None)`.

    Megatron's rule: an even-length list whose every other entry (from the
    first) parses as a float is weight/prefix pairs; anything else is a list
    of prefixes. A prefix that does not exist is reported when it is opened.
    """
    if blend is None:
        return None
    blend = list(blend)
    if len(blend) == 0:
        raise ValueError("the data path list is empty: give one or more prefixes, or weight/prefix pairs")
    weights: Optional[List[float]] = None
    prefixes = blend
    if len(blend) % 2 == 0:
        parsed = []
        for raw in blend[0::2]:
            try:
                parsed.append(float(raw))
            except ValueError:
                parsed = None
                break
        if parsed is not None:
            weights, prefixes = parsed, blend[1::2]
            check_weights(weights, "data path weights")
    return [p.strip() for p in prefixes], weights


def get_blend_and_blend_per_split(args) -> Tuple[Optional[tuple], Optional[list]]:
    """`(blend, blend_per_split)` from `--data-path`/`--data-args-path` or the per-split flags.

    Megatron-LM's `megatron.training.utils.get_blend_and_blend_per_split`.
    """
    import json

    data_path = getattr(args, "data_path", None)
    data_args_path = getattr(args, "data_args_path", None)
    per_split = [getattr(args, f"{s}_data_path", None) for s in ("train", "valid", "test")]
    per_split_args_path = getattr(args, "per_split_data_args_path", None)
    use_data_path = data_path is not None or data_args_path is not None
    use_per_split = any(p is not None for p in per_split) or per_split_args_path is not None
    if use_data_path and use_per_split:
        raise ValueError("--data-path/--data-args-path and --train/valid/test-data-path/"
                         "--per-split-data-args-path exclude each other")
    if use_data_path:
        if data_args_path is not None:
            if data_path is not None:
                raise ValueError("--data-path and --data-args-path exclude each other")
            with open(data_args_path) as f:
                return get_blend_from_list(f.read().split()), None
        return get_blend_from_list(data_path), None
    if use_per_split:
        if per_split_args_path is not None:
            with open(per_split_args_path) as f:
                loaded = json.load(f)
            missing = [k for k in ("train", "valid", "test") if k not in loaded]
            if missing:
                raise ValueError(f"--per-split-data-args-path {per_split_args_path}: missing keys {missing}; "
                                 "it must be a JSON object with 'train', 'valid' and 'test'")
            per_split = [loaded[k].split() if isinstance(loaded[k], str) else loaded[k]
                         for k in ("train", "valid", "test")]
        return None, [get_blend_from_list(p) for p in per_split]
    return None, None
