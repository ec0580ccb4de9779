"""`BlendedDataset`: several MegatronDatasets interleaved by weight (Megatron's blending indices)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Union

import numpy
import torch

from megatron_fsdp.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_fsdp.datasets.helpers import build_blending_indices, build_exhaustive_blending_indices
from megatron_fsdp.datasets.index_cache import IndexCache
from megatron_fsdp.datasets.megatron_dataset import MegatronDataset, _describe
from megatron_fsdp.datasets.utils import check_weights, log_single_rank, normalize

logger = logging.getLogger(__name__)

_VERBOSE = False


class BlendedDataset(torch.utils.data.Dataset):
    """Sample i comes from `datasets[dataset_index[i]]`, its `dataset_sample_index[i]`-th sample.

    `size=None` draws every sample of every dataset exactly once (integer `weights` = the counts).
    """

    def __init__(self, datasets: List[MegatronDataset], weights: List[Union[int, float]], size: Optional[int],
                 config: BlendedMegatronDatasetConfig) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        if not 0 < len(datasets) < 32767:
            raise ValueError(f"BlendedDataset blends 1 to 32766 datasets, got {len(datasets)}")
        if any(type(d) is not type(datasets[0]) for d in datasets):
            raise ValueError("BlendedDataset: every blended dataset must be of the same class")
        if any(d.index_split != datasets[0].index_split for d in datasets):
            raise ValueError("BlendedDataset: every blended dataset must belong to the same split")
        check_weights(list(weights), f"BlendedDataset ({datasets[0].index_split.name} split)")
        if size is None and any(w != int(w) for w in weights):
            raise ValueError(f"BlendedDataset with size=None draws weights[i] samples from dataset i: "
                             f"weights must be whole numbers, got {weights}")
        if size is not None and size < 0:
            raise ValueError(f"BlendedDataset size must be >= 0 or None, got {size}")
        if len(datasets) == 1:
            log_single_rank(logger, logging.WARNING, "Building a BlendedDataset for a single MegatronDataset")
        if size is not None:
            weights = normalize(weights)

        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [dataset.unique_identifiers for dataset in self.datasets]
        unique_identifiers["split"] = self.split.name
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_description = json.dumps(unique_identifiers, indent=4, default=_describe)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8"),
                                                   usedforsecurity=False).hexdigest()
        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Union[int, numpy.ndarray]]:
        dataset_id = self.dataset_index[idx]
        dataset_sample_id = self.dataset_sample_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][dataset_sample_id]}

    def _build_indices(self):
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
        cache = IndexCache(self.config.path_to_cache, base, ["dataset_index", "dataset_sample_index"])
        if not cache.should_build():
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} indices from "
                                                  f"{self.config.path_to_cache}")
            loaded = cache.load()
            return loaded["dataset_index"], loaded["dataset_sample_index"]

        log_single_rank(logger, logging.INFO, f"Build and save the {type(self).__name__} indices")
        t_beg = time.time()
        if self.size is not None:
            dataset_index = numpy.zeros(self.size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(self.size, dtype=numpy.int64)
            build_blending_indices(dataset_index, dataset_sample_index, self.weights, len(self.datasets),
                                   self.size, _VERBOSE)
        else:
            size = int(sum(self.weights))
            dataset_index = numpy.zeros(size, dtype=numpy.int16)
            dataset_sample_index = numpy.zeros(size, dtype=numpy.int64)
            build_exhaustive_blending_indices(dataset_index, dataset_sample_index, [int(w) for w in self.weights],
                                              len(self.datasets))

        indices, counts = numpy.unique(dataset_index, return_counts=True)
        for i, (index, count) in enumerate(zip(indices, counts)):
            if len(self.datasets[index]) < count:
                raise IndexError(
                    f"The {self.split.name} blend oversamples the contributing datasets and, for example, "
                    f"requests {count} samples from {type(self.datasets[index]).__name__} number {i} in excess "
                    f"of its size {len(self.datasets[index])}. Increase mid_level_dataset_surplus "
                    f"(now {self.config.mid_level_dataset_surplus}), e.g. two- or ten-fold.")
        cache.save(self.unique_description, {"dataset_index": dataset_index,
                                             "dataset_sample_index": dataset_sample_index})
        log_single_rank(logger, logging.INFO, f"> {self.split.name} blend of {len(self.datasets)} datasets: "
                                              f"{len(dataset_index)} samples, built in {time.time() - t_beg:.2f} s")
        return dataset_index, dataset_sample_index
