"""`MegatronDataset`: the base of mid-level datasets (a split of one low-level dataset)."""

from __future__ import annotations

import hashlib
import json
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Union

import numpy
import torch

from megatron_fsdp.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_fsdp.datasets.indexed_dataset import IndexedDataset
from megatron_fsdp.datasets.utils import Split

LowLevelDataset = Union[IndexedDataset, Iterable]

_PAD_TOKEN_ID = -1


def _describe(obj):
    if hasattr(obj, "unique_identifiers"):
        return obj.unique_identifiers
    raise TypeError(f"{type(obj).__name__} cannot be part of a dataset cache key: "
                    "give it a `unique_identifiers` property")


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """A split of a low-level dataset with a cache key (`unique_description_hash`) for its indices."""

    def __init__(self, dataset: LowLevelDataset, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: BlendedMegatronDatasetConfig) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config

        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = self.dataset_path
        self.unique_identifiers["num_samples"] = self.num_samples
        self.unique_identifiers["index_split"] = self.index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(self.config, attr)
        self.unique_identifiers.update(self._key_data_attributes())
        self.unique_description = json.dumps(self.unique_identifiers, indent=4, default=_describe)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8"),
                                                   usedforsecurity=False).hexdigest()
        self._pad_token_id = self._resolve_pad_token_id()

    def _resolve_pad_token_id(self) -> int:
        tokenizer = self.config.tokenizer
        pad = getattr(tokenizer, "pad", None) if tokenizer is not None else None
        if pad is None:
            return _PAD_TOKEN_ID
        special = []
        for name in ("eos", "eod"):
            try:
                value = getattr(tokenizer, name)
            except (AttributeError, NotImplementedError):
                continue
            if value is not None:
                special.append(value)
        if pad in special:
            if self.config.allow_ambiguous_pad_tokens:
                warnings.warn("The pad token id of the tokenizer equals another special token id; with "
                              "allow_ambiguous_pad_tokens those tokens are masked out of the loss as padding.")
                return pad
            warnings.warn("The pad token id of the tokenizer equals another special token id; pad tokens "
                          f"are not masked (pad id {_PAD_TOKEN_ID} is used instead). Give the tokenizer a "
                          "distinct pad token to mask padding.")
            return _PAD_TOKEN_ID
        return pad

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: LowLevelDataset) -> int:
        """How many elements (sequences, for GPT) the split boundaries divide."""
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> LowLevelDataset:
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> List[str]:
        """Config attributes that identify the built indices (Megatron's list)."""
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    def _key_data_attributes(self) -> Dict[str, object]:
        """More cache-key entries (ours, not Megatron's): whatever else changes the indices."""
        return {}

    @abstractmethod
    def __len__(self) -> int:
        ...

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Union[torch.Tensor, numpy.ndarray]]:
        ...
