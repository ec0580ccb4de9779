"""`--tokenizer-type NullTokenizer`: text is space-separated token ids (for tests and benchmarks)."""

from __future__ import annotations

from typing import List, Optional

from megatron_fsdp.training.tokenizer.base import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """`"3 1 4" -> [3, 1, 4]`; eod is `vocab_size - 1` unless given; pad -1 (none) unless given."""

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1) -> None:
        vocab_size = int(vocab_size)
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        eod_id = vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= eod_id < vocab_size:
            raise ValueError(f"NullTokenizer: --null-tokenizer-eod-id {eod_id} is outside the vocabulary "
                             f"[0, {vocab_size})")
        super().__init__(vocab_size=vocab_size, eod_id=eod_id, pad_id=int(pad_id))
        self._vocab_size, self._eod_id, self._pad_id = vocab_size, eod_id, int(pad_id)

    def tokenize(self, text: str) -> List[int]:
        if text == "":  # Megatron fails on int(""); an empty text is simply no tokens
            return []
        try:
            return [int(x) for x in text.split(" ")]
        except ValueError:
            raise ValueError(f"NullTokenizer reads space-separated integers, got {text[:80]!r}") from None

    def detokenize(self, ids: List[int]) -> str:
        return " ".join(str(int(x)) for x in ids)

    def offsets(self, ids: List[int], text: str) -> List[int]:
        offsets, start = [], 0
        for id_ in ids:
            offsets.append(start)
            start += 1 + len(str(id_))
        return offsets

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def pad(self) -> int:
        return self._pad_id
