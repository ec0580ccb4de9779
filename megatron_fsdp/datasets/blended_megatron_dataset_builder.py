"""`BlendedMegatronDatasetBuilder`: train/valid/test datasets from `--data-path` + `--split` or per-split paths.

Distributed: call `build()` on every rank. Rank 0 builds each dataset first (writing the index
caches) while the others wait (an error on rank 0 is raised on every rank), then the others build
and read the caches; ranks where `is_built_on_rank()` is False get None (Megatron's
tensor-parallel ranks > 0, say).
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, List, Optional, Type, Union

import numpy
import torch

from megatron_fsdp.datasets.blended_dataset import BlendedDataset
from megatron_fsdp.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_fsdp.datasets.megatron_dataset import LowLevelDataset, MegatronDataset
from megatron_fsdp.datasets.utils import Split, log_single_rank, normalize
from megatron_fsdp.utils import broadcast_from_rank0, is_distributed

logger = logging.getLogger(__name__)

MidLevelDataset = MegatronDataset
TopLevelDataset = Union[BlendedDataset, MidLevelDataset]
DistributedDataset = Union[TopLevelDataset, MidLevelDataset, LowLevelDataset, torch.utils.data.Dataset]


class BlendedMegatronDatasetBuilder:
    """Megatron-Core's builder: `BlendedMegatronDatasetBuilder(cls, sizes, is_built_on_rank, config).build()`.

    `sizes` holds the number of samples wanted per split (train, valid, test), None for "one epoch".
    """

    def __init__(self, cls: Type[MidLevelDataset], sizes: List[Optional[int]], is_built_on_rank: Callable,
                 config: BlendedMegatronDatasetConfig):
        if len(sizes) != len(Split):
            raise ValueError(f"BlendedMegatronDatasetBuilder: sizes must hold {len(Split)} entries "
                             f"(train, valid, test), got {sizes}")
        bad = [s for s in sizes if s is not None and (not isinstance(s, (int, numpy.integer)) or s < 0)]
        if bad:
            raise ValueError(f"BlendedMegatronDatasetBuilder: sample counts must be integers >= 0 or None, got {sizes}")
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        log_single_rank(logger, logging.INFO, f"Building {cls.__name__} splits with sizes={self.sizes}")
        if not config.mock:
            for split in Split:
                if config.blend_per_split is None:
                    weights = config.blend[1]
                elif config.blend_per_split[split.value] is None:
                    continue
                else:
                    weights = config.blend_per_split[split.value][1]
                if self.sizes[split.value] is None and weights is not None:
                    raise ValueError(f"the {split.name} split has dataset weights but no sample count: "
                                     "weighted blends need a size (weights imply sampling to a target)")

    def build(self) -> List[Optional[TopLevelDataset]]:
        """One dataset (or None) per split: `[train, valid, test]`."""
        self._check_inputs()
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if isinstance(dataset, BlendedDataset) and len(dataset) > 0:
                assert dataset.size is None or dataset.size == len(dataset)
            elif isinstance(dataset, MegatronDataset) and len(dataset) > 0:
                if dataset.num_samples is not None and dataset.num_samples > len(dataset):
                    raise RuntimeError(f"the {dataset.index_split.name} dataset holds {len(dataset)} samples, "
                                       f"{dataset.num_samples} were requested")
        return datasets

    def _check_inputs(self) -> None:
        """Open every prefix and check every split on every rank, before any barrier: a bad
        prefix or an empty split is the same clear error everywhere instead of a hang."""
        if self.config.mock:
            return
        if self.config.blend:
            jobs = [(p, self.config.split_matrix, self.sizes) for p in self.config.blend[0]]
        else:
            jobs = []
            for i, blend in enumerate(self.config.blend_per_split):
                if blend is not None:
                    split = [None] * len(Split)
                    split[i] = (0.0, 1.0)
                    sizes = [0] * len(Split)
                    sizes[i] = self.sizes[i]
                    jobs += [(p, split, sizes) for p in blend[0]]
        for prefix, split, sizes in jobs:
            num_elements = self.cls.numel_low_level_dataset(self.cls.build_low_level_dataset(prefix, self.config))
            for i, _split in enumerate(Split):
                if split[i] is None or sizes[i] == 0:
                    continue
                beg, end = _split_bounds(split[i], num_elements)
                if end <= beg:
                    raise ValueError(
                        f"the {_split.name} split of {prefix} is empty: {num_elements} sequences, split "
                        f"book-ends {split[i]} select [{beg}, {end}); give the {_split.name} split a larger "
                        "share (--split) or more data")

    def _build_blended_dataset_splits(self) -> List[Optional[TopLevelDataset]]:
        config = self.config
        if config.mock:
            return self._build_megatron_dataset_splits(None, config.split_matrix, self.sizes)
        if config.blend:
            prefixes, weights = config.blend
            if weights is not None:
                weights = normalize(weights)
            split = config.split_matrix
            if len(prefixes) == 1 and weights is None:
                return self._build_megatron_dataset_splits(prefixes[0], split, self.sizes)
            if weights is None:
                sizes_per_dataset_buffer = [[None for _ in Split] for _ in prefixes]
            else:
                sizes_per_dataset_target = _get_size_per_split_per_dataset(weights, self.sizes)
                sizes_per_dataset_buffer = _get_size_per_split_per_dataset(
                    weights, self.sizes, surplus=config.mid_level_dataset_surplus)
            megatron_datasets = self._build_megatron_datasets_parallel(prefixes, split, sizes_per_dataset_buffer)
            blended_datasets: List[Optional[TopLevelDataset]] = [None] * len(Split)
            for i in range(len(Split)):
                if split[i] is None or self.sizes[i] == 0:  # no samples wanted: no blend (on every rank)
                    continue
                weights_i, size_i = self._top_level_weights_and_size(
                    weights, megatron_datasets[i], None if weights is None else
                    sum(list(zip(*sizes_per_dataset_target))[i]), self.sizes[i], len(prefixes))
                blended_datasets[i] = self.build_generic_dataset(
                    BlendedDataset, self.is_built_on_rank, True, megatron_datasets[i], weights_i, size_i, config)
            return blended_datasets

        blended_datasets = [None] * len(Split)
        for i in range(len(Split)):
            blend = config.blend_per_split[i]
            if blend is None or (self.sizes[i] == 0 and len(blend[0]) > 1):
                continue
            split_spoof = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            prefixes, weights = blend
            if weights is not None:
                weights = normalize(weights)
            if len(prefixes) == 1:
                blended_datasets[i] = self._build_megatron_dataset_splits(prefixes[0], split_spoof, sizes_spoof)[i]
                continue
            if config.multiple_validation_sets and i == Split.valid.value:
                if config.full_validation and sizes_spoof[i] is not None:
                    raise ValueError("full_validation builds one epoch of each validation set: its size must be None")
                blended_datasets[i] = [self._build_megatron_dataset_splits(p, split_spoof, sizes_spoof)[i]
                                       for p in prefixes]
                continue
            if weights is None:
                sizes_per_dataset_buffer = [[None for _ in Split] for _ in prefixes]
                target = None
            else:
                target = sum(list(zip(*_get_size_per_split_per_dataset(weights, sizes_spoof)))[i])
                sizes_per_dataset_buffer = _get_size_per_split_per_dataset(
                    weights, sizes_spoof, surplus=config.mid_level_dataset_surplus)
            megatron_datasets = self._build_megatron_datasets_parallel(
                prefixes, split_spoof, sizes_per_dataset_buffer)[i]
            weights_i, size_i = self._top_level_weights_and_size(weights, megatron_datasets, target, self.sizes[i],
                                                                 len(prefixes))
            blended_datasets[i] = self.build_generic_dataset(
                BlendedDataset, self.is_built_on_rank, True, megatron_datasets, weights_i, size_i, config)
        return blended_datasets

    @staticmethod
    def _top_level_weights_and_size(weights, megatron_datasets, target, requested, num_prefixes):
        if weights is not None:
            if requested is None:
                raise ValueError("Using client-specified weights requires client-specified size")
            return weights, target
        try:
            weights = [len(d) for d in megatron_datasets]
        except TypeError:  # not built on this rank
            weights = [0 for _ in range(num_prefixes)]
        size = None if requested is None else min(requested, sum(weights))
        return weights, size

    def _build_megatron_datasets_parallel(self, prefixes: List[str], split, sizes_per_dataset
                                          ) -> List[List[Optional[MegatronDataset]]]:
        """Every prefix's splits; threads build several prefixes at once (rank 0 first)."""
        megatron_datasets: List[List[Optional[MegatronDataset]]] = [[] for _ in Split]

        def build_all(num_workers: int) -> None:
            with ThreadPoolExecutor(max_workers=num_workers) as executor:
                futures = [executor.submit(self._build_megatron_dataset_splits, prefixes[i], split,
                                           sizes_per_dataset[i], False) for i in range(len(prefixes))]
                for future in futures:
                    for j, dataset in enumerate(future.result()):
                        megatron_datasets[j].append(dataset)

        threads = self.config.num_dataset_builder_threads
        if is_distributed():
            _rank0_first(lambda: build_all(threads))
        else:
            build_all(threads)
        return megatron_datasets

    def _build_megatron_dataset_splits(self, dataset_path: Optional[str], split, sizes: List[Optional[int]],
                                       synchronize_ranks: bool = True) -> List[Optional[MidLevelDataset]]:
        """Each split of one low-level dataset (None where the split is empty)."""
        if is_distributed() and not self.is_built_on_rank():
            for i in range(len(Split)):
                if split[i] is not None and synchronize_ranks:
                    _rank0_first(lambda: None)  # the collective the building ranks run
            return [None] * len(Split)

        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        mid_level_datasets: List[Optional[MidLevelDataset]] = []
        for i, _split in enumerate(Split):
            if split[i] is None:
                mid_level_datasets.append(None)
                continue
            beg, end = _split_bounds(split[i], num_elements)
            if end <= beg and sizes[i] == 0:  # an empty split nobody samples from
                mid_level_datasets.append(None)
                continue
            indexed_indices = numpy.arange(start=beg, stop=end, step=1, dtype=numpy.int32)
            mid_level_datasets.append(self.build_generic_dataset(
                self.cls, self.is_built_on_rank, synchronize_ranks, low_level_dataset, dataset_path,
                indexed_indices, sizes[i], _split, self.config))
        return mid_level_datasets

    @staticmethod
    def build_generic_dataset(cls: Union[Type[DistributedDataset], Callable], is_built_on_rank: Callable,
                              synchronize_ranks: bool, *args: Any) -> Optional[Union[DistributedDataset, Iterable]]:
        """`cls(*args)`: on rank 0 first, then on the other ranks that build (see _rank0_first)."""
        if not is_distributed():
            return cls(*args)
        build = (lambda: cls(*args)) if is_built_on_rank() else (lambda: None)
        if synchronize_ranks:
            return _rank0_first(build)
        return build()


def _rank0_first(build: Callable[[], Any]) -> Any:
    """`build()` on rank 0 (which writes the index caches), then on the other ranks (which
    read them). A failure on rank 0 is raised on every rank: the others would otherwise wait
    for it in a barrier until the distributed timeout."""
    rank = torch.distributed.get_rank()
    result, error = None, None
    if rank == 0:
        try:
            result = build()
        except Exception as exc:  # re-raised below, after the others have heard of it
            error = exc
    status = broadcast_from_rank0(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if status is not None:
        raise RuntimeError(f"building the datasets failed on rank 0: {status}")
    return build() if rank != 0 else result


def _split_bounds(bookends, num_elements: int):
    """Megatron's rounding of split book-ends to element indices (Python's round: half to even)."""
    return int(round(bookends[0] * float(num_elements))), int(round(bookends[1] * float(num_elements)))


def _get_size_per_split_per_dataset(normalized_weights: List[float], target_size_per_split: List[Optional[int]],
                                    surplus: float = 0.0) -> List[List[int]]:
    """Samples to request per dataset per split: ceil(ceil(size * weight) * (1 + surplus))."""
    if not numpy.isclose(sum(normalized_weights), 1.0):
        raise ValueError(f"normalized weights must sum to 1, got {sum(normalized_weights)}")
    return [[int(math.ceil(math.ceil(target_size * weight) * (1 + surplus))) for target_size in target_size_per_split]
            for weight in normalized_weights]
