"""GPT samples the Megatron way: `GPTDatasetConfig`, `GPTDataset`, `MockGPTDataset`.

A split's documents are shuffled into a document index (one shuffle per epoch set), the
flattened token stream is cut into samples of `sequence_length` (+1 shared) tokens (the sample
index), and samples are visited in a shuffled order (the shuffle index). When the last epoch
contributes fewer than 80% of an epoch's samples it is shuffled on its own, so the few samples
drawn from it are not concentrated on a handful of documents. All three indices use one
`numpy.random.RandomState(random_seed)` in Megatron's order, so the samples equal Megatron's.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy
import torch

from megatron_fsdp.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_fsdp.datasets.helpers import build_sample_idx
from megatron_fsdp.datasets.index_cache import IndexCache
from megatron_fsdp.datasets.indexed_dataset import IndexedDataset
from megatron_fsdp.datasets.masks import _get_ltor_masks_and_position_ids, document_cu_seqlens
from megatron_fsdp.datasets.megatron_dataset import MegatronDataset
from megatron_fsdp.datasets.utils import Split, log_single_rank
from megatron_fsdp.utils import reject_unsupported

logger = logging.getLogger(__name__)

_LAST_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """Megatron-Core's GPT dataset options (same names and defaults)."""

    reset_position_ids: Optional[bool] = None
    reset_attention_mask: Optional[bool] = None
    eod_mask_loss: Optional[bool] = None
    create_attention_mask: bool = True
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    object_storage_cache_path: Optional[str] = None
    data_parallel_size: int = 1
    sequence_parallel_size: int = 0
    hybrid_context_parallel: bool = False
    sequences_per_dataset: Optional[Dict[str, int]] = None
    token_dtype_code: Optional[int] = field(init=False, default=None)
    context_parallel_size: Optional[int] = None
    inter_document_masking: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        where = type(self).__name__
        if self.tokenizer is None:
            raise ValueError(f"{where}: tokenizer is required (its eod id marks document ends)")
        missing = [n for n in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
                   if getattr(self, n) is None]
        if missing:
            raise ValueError(f"{where}: {', '.join(missing)} must be set to True or False")
        reject_unsupported(where, {
            "object_storage_cache_path": (self.object_storage_cache_path, None,
                                          "data must be on a local or mounted file system"),
            "hybrid_context_parallel": (self.hybrid_context_parallel, False),
            "sequences_per_dataset": (self.sequences_per_dataset, None, "counts are read from each .idx"),
        }, error=ValueError)
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        self.token_dtype_code = None if vocab_size is None else (4 if vocab_size > numpy.iinfo(numpy.uint16).max + 1
                                                                 else 8)


class GPTDataset(MegatronDataset):
    """Samples `{tokens, labels, loss_mask, position_ids[, attention_mask]}` from an IndexedDataset split."""

    def __init__(self, indexed_dataset: IndexedDataset, dataset_path: Optional[str], indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.masks_and_position_ids_are_cacheable = not any(
            [config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss])
        self.masks_and_position_ids_are_cached = False
        self.cached_attention_mask = None
        self.cached_loss_mask = None
        self.cached_position_ids = None
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: IndexedDataset) -> int:
        # GPT splits by sequence (several per document with --split-sentences), as Megatron does.
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    def _key_data_attributes(self) -> Dict[str, object]:
        # Megatron keys its cache on the path only: a re-tokenized corpus at the same prefix, or
        # another add_extra_token_to_sequence, would silently reuse stale indices.
        sizes = getattr(self.dataset, "sequence_lengths", None)
        return {
            "add_extra_token_to_sequence": self.config.add_extra_token_to_sequence,
            "drop_last_partial_validation_sequence": self.config.drop_last_partial_validation_sequence,
            "sequence_count": None if sizes is None else int(len(sizes)),
            "split_tokens": None if sizes is None else self._get_num_tokens_per_epoch(),
        }

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        text, _, document_lengths = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        text = torch.from_numpy(text).long()
        if self.config.add_extra_token_to_sequence:
            tokens = text[:-1].contiguous()
            labels = text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id

        if not self.masks_and_position_ids_are_cacheable or not self.masks_and_position_ids_are_cached:
            attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
                tokens, self.config.tokenizer.eod, self.config.reset_position_ids,
                self.config.reset_attention_mask, self.config.eod_mask_loss, self.config.create_attention_mask)
            if self.masks_and_position_ids_are_cacheable:
                self.cached_attention_mask = attention_mask
                self.cached_loss_mask = loss_mask
                self.cached_position_ids = position_ids
                self.masks_and_position_ids_are_cached = True
        else:
            attention_mask = self.cached_attention_mask
            loss_mask = self.cached_loss_mask.clone()
            position_ids = self.cached_position_ids

        loss_mask[labels == self._pad_token_id] = 0.0
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:  # a padding sample: contributes nothing to the loss
            loss_mask = torch.zeros_like(loss_mask)

        result = {"tokens": tokens, "labels": labels}
        if self.config.inter_document_masking:
            cu_seqlens, max_seqlen, position_ids = document_cu_seqlens(
                document_lengths, self.config.sequence_length, self.config.add_extra_token_to_sequence)
            result.update(loss_mask=loss_mask, position_ids=position_ids, cu_seqlens=cu_seqlens,
                          max_seqlen=max_seqlen)
            return result
        if self.config.create_attention_mask:
            result["attention_mask"] = attention_mask
        result.update(loss_mask=loss_mask, position_ids=position_ids)
        return result

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray, List[int]]:
        """The sample's tokens (padded to full length), its document ids, and each part's length."""
        extra = self.config.add_extra_token_to_sequence
        idx = self.shuffle_index[idx]
        doc_index_beg, doc_index_beg_offset = self.sample_index[idx]
        doc_index_end, doc_index_end_offset = self.sample_index[idx + 1]
        document_ids, sample_parts = [], []
        if doc_index_beg == doc_index_end:
            document_ids.append(self.document_index[doc_index_beg])
            sample_parts.append(self.dataset.get(
                self.document_index[doc_index_beg], offset=int(doc_index_beg_offset),
                length=int(doc_index_end_offset - doc_index_beg_offset + extra)))
        else:
            for i in range(doc_index_beg, doc_index_end + 1):
                document_ids.append(self.document_index[i])
                offset = 0 if i > doc_index_beg else int(doc_index_beg_offset)
                length = None if i < doc_index_end else int(doc_index_end_offset + extra)
                sample_parts.append(self.dataset.get(self.document_index[i], offset=offset, length=length))
        document_lengths = [len(p) for p in sample_parts]
        missing = self.config.sequence_length + extra - sum(document_lengths)
        if missing > 0:
            sample_parts.append(numpy.full(missing, self._pad_token_id, dtype=numpy.int64))
        return (numpy.concatenate(sample_parts, dtype=numpy.int64), numpy.array(document_ids, dtype=numpy.int64),
                document_lengths)

    def _build_document_sample_shuffle_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        """Build (or load from the cache) the document, sample and shuffle indices."""
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None and not self.config.mock:
            path_to_cache = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        cache = IndexCache(path_to_cache, base, ["document_index", "sample_index", "shuffle_index"])
        if not cache.should_build():
            log_single_rank(logger, logging.INFO, f"Load the {type(self).__name__} {self.index_split.name} indices "
                                                  f"from {path_to_cache}")
            loaded = cache.load()
            return loaded["document_index"], loaded["sample_index"], loaded["shuffle_index"]

        log_single_rank(logger, logging.INFO,
                        f"Build and save the {type(self).__name__} {self.index_split.name} indices")
        t_beg = time.time()
        sequence_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        num_tokens_per_epoch = self._get_num_tokens_per_epoch()
        if num_tokens_per_epoch <= extra:
            raise ValueError(f"the {self.index_split.name} split of {self.dataset_path} holds "
                             f"{num_tokens_per_epoch} tokens in {len(self.indices)} sequences: too few for one "
                             f"sample; change --split or the data")
        num_epochs = self._get_num_epochs(num_tokens_per_epoch)
        separate_final_epoch = False
        if num_epochs > 1:
            num_samples_sans_final_epoch = ((num_epochs - 1) * num_tokens_per_epoch - extra) // sequence_length
            num_samples_from_final_epoch = self.num_samples - num_samples_sans_final_epoch
            num_samples_per_epoch = (num_tokens_per_epoch - extra) // sequence_length
            if not 0 <= num_samples_from_final_epoch <= num_samples_per_epoch + 1:
                raise AssertionError(f"last epoch sample count {num_samples_from_final_epoch} out of range "
                                     f"[0, {num_samples_per_epoch + 1}]")
            # The last-epoch rule: fewer than 80% of an epoch's samples -> shuffle that epoch apart.
            separate_final_epoch = num_samples_from_final_epoch < int(_LAST_EPOCH_THRESHOLD * num_samples_per_epoch)

        numpy_random_state = numpy.random.RandomState(self.config.random_seed)
        # Stage lines: on a large corpus each stage takes seconds to minutes.
        log_single_rank(logger, logging.INFO, f"\tdocument index: {num_epochs} epoch(s) x {len(self.indices)} "
                                              f"sequences ({num_tokens_per_epoch} tokens per epoch)")
        document_index = _build_document_index(self.indices, num_epochs, numpy_random_state, separate_final_epoch)
        log_single_rank(logger, logging.INFO, f"\tsample index ({time.time() - t_beg:.1f} s so far)")
        drop_last = True if self.index_split != Split.valid else self.config.drop_last_partial_validation_sequence
        sequence_lengths = numpy.asarray(self.dataset.sequence_lengths, dtype=numpy.int32)
        sample_index = build_sample_idx(sequence_lengths, document_index, sequence_length, num_epochs,
                                        num_tokens_per_epoch, drop_last, self.config.add_extra_token_to_sequence)
        total = sample_index.shape[0] - 1
        first = num_samples_sans_final_epoch if separate_final_epoch else total
        log_single_rank(logger, logging.INFO, f"\tshuffle index: {total} samples ({time.time() - t_beg:.1f} s so far)")
        shuffle_index = _build_shuffle_index(first, total, numpy_random_state)

        cache.save(self.unique_description, {"document_index": document_index, "sample_index": sample_index,
                                             "shuffle_index": shuffle_index})
        log_single_rank(logger, logging.INFO, f"> {self.index_split.name}: {total} samples, {num_epochs} epoch(s), "
                                              f"separate last epoch: {separate_final_epoch}, built in "
                                              f"{time.time() - t_beg:.2f} s")
        return document_index, sample_index, shuffle_index

    def _get_num_tokens_per_epoch(self) -> int:
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices], dtype=numpy.int64))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        if self.num_samples is None:
            return 1
        requested = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        return max(1, -(-requested // num_tokens_per_epoch))


def _build_document_index(documents: numpy.ndarray, num_epochs: int, numpy_random_state: numpy.random.RandomState,
                          separate_final_epoch: bool) -> numpy.ndarray:
    """`num_epochs` copies of the split's document ids, shuffled (the last epoch apart when asked)."""
    if not separate_final_epoch or num_epochs == 1:
        document_index = numpy.tile(numpy.asarray(documents), num_epochs).astype(numpy.int32)
        numpy_random_state.shuffle(document_index)
        return document_index
    first = _build_document_index(documents, num_epochs - 1, numpy_random_state, False)
    last = _build_document_index(documents, 1, numpy_random_state, False)
    return numpy.concatenate((first, last))


def _build_shuffle_index(num_samples: int, total_size: int,
                         numpy_random_state: numpy.random.RandomState) -> numpy.ndarray:
    """A permutation of [0, num_samples), then (if shorter than total_size) of [num_samples, total_size)."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    first = numpy.arange(0, num_samples, dtype=dtype)
    numpy_random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    numpy_random_state.shuffle(last)
    return numpy.concatenate((first, last))


class MockGPTLowLevelDataset:
    """Megatron's synthetic corpus: 100000 sequences of random length, tokens 1, 2, ... then eod."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod_token = tokenizer.eod
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size, dtype=numpy.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = self.sequence_lengths[idx]
        return numpy.int64(numpy.concatenate([(numpy.arange(length - 1) + 1) % self.vocab_size, [self.eod_token]]))

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        if length is None:
            length = self.sequence_lengths[idx] - offset
        return self[idx][offset:offset + length]


class MockGPTDataset(GPTDataset):
    """A GPTDataset over MockGPTLowLevelDataset (`--mock-data`): built by the same builder, no files."""

    def __init__(self, dataset: MockGPTLowLevelDataset, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: int, index_split: Split, config: GPTDatasetConfig) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a config without blend/blend_per_split (mock data)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)

