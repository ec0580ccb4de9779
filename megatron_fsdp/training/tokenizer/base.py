"""What every tokenizer offers (Megatron's `MegatronTokenizerText` face)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Dict, List, Optional


class MegatronTokenizer(ABC):
    """`tokenize(text) -> ids`, `detokenize(ids) -> text`, `vocab_size`, and the special ids.

    A special token the tokenizer does not have is None (`pad` of GPT-2, say).
    `unique_identifiers` keys the dataset index caches.
    """

    def __init__(self, **identifiers) -> None:
        self._identifiers = identifiers

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        ...

    @abstractmethod
    def detokenize(self, ids: List[int]) -> str:
        ...

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        ...

    @property
    def vocab(self) -> Dict[str, int]:
        raise NotImplementedError(f"{type(self).__name__} has no string vocabulary")

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def eod(self) -> Optional[int]:
        return None

    @property
    def pad(self) -> Optional[int]:
        return None

    @property
    def bos(self) -> Optional[int]:
        return None

    @property
    def eos(self) -> Optional[int]:
        return self.eod

    @property
    def pad_id(self) -> Optional[int]:
        return self.pad

    @property
    def bos_id(self) -> Optional[int]:
        return self.bos

    @property
    def eos_id(self) -> Optional[int]:
        return self.eos

    @property
    def unique_identifiers(self) -> OrderedDict:
        identifiers = OrderedDict(**{"class": f"{type(self).__module__}.{type(self).__qualname__}"})
        identifiers.update((k, str(v)) for k, v in self._identifiers.items())
        return identifiers
