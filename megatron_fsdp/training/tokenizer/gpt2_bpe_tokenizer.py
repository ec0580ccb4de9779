"""`--tokenizer-type GPT2BPETokenizer` with `--vocab-file` and `--merge-file` (local files only)."""

from __future__ import annotations

import os
from typing import Dict, List, Optional

from megatron_fsdp.training.tokenizer.base import MegatronTokenizer
from megatron_fsdp.training.tokenizer.gpt2_tokenization import GPT2Tokenizer

_EOD = "<|endoftext|>"


class GPT2BPETokenizer(MegatronTokenizer):
    """GPT-2's tokenizer: eod/eos/bos = `<|endoftext|>` (50256 in GPT-2's files), no pad token."""

    def __init__(self, vocab_file: Optional[str], merge_file: Optional[str],
                 additional_special_tokens: Optional[List[str]] = None) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise ValueError(f"GPT2BPETokenizer needs {flag} (GPT-2's vocab.json / merges.txt); "
                                 "nothing is downloaded")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"GPT2BPETokenizer: {flag} {path} does not exist")
        extra = list(additional_special_tokens or [])
        super().__init__(vocab_file=os.path.abspath(vocab_file), merge_file=os.path.abspath(merge_file),
                         additional_special_tokens=extra)
        self.tokenizer = GPT2Tokenizer(vocab_file, merge_file, special_tokens=[_EOD, *extra])
        self.additional_special_tokens_ids = [self.tokenizer.encoder[t] for t in extra]

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer.encoder)

    @property
    def vocab(self) -> Dict[str, int]:
        return self.tokenizer.encoder

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self.tokenizer.decoder

    @property
    def eod(self) -> int:
        return self.tokenizer.encoder[_EOD]

    @property
    def bos(self) -> int:
        return self.eod
