"""`--tokenizer-type HuggingFaceTokenizer` from local files, through the `tokenizers` package.

`--tokenizer-model` is a folder holding `tokenizer.json` (and usually `tokenizer_config.json`,
as Megatron reads it through `transformers.AutoTokenizer`), or a `tokenizer.json` path. The
special tokens come from `tokenizer_config.json`/`special_tokens_map.json` beside it. Ids are
those of a Hugging Face fast tokenizer: `tokenizer(text).input_ids` (with the post-processor's
specials, a BOS say) unless `include_special_tokens=False`; eod is the id of `eos_token`; the
vocabulary size counts added tokens (`len(tokenizer)`). Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from megatron_fsdp.training.tokenizer.base import MegatronTokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class HuggingFaceTokenizer(MegatronTokenizer):
    def __init__(self, tokenizer_path: str, include_special_tokens: bool = True,
                 additional_special_tokens: Optional[List[str]] = None) -> None:
        try:
            import tokenizers
        except ImportError:
            raise ImportError("--tokenizer-type HuggingFaceTokenizer needs the `tokenizers` package "
                              "(pip install tokenizers)") from None
        if os.path.isdir(tokenizer_path):
            folder, json_path = tokenizer_path, os.path.join(tokenizer_path, "tokenizer.json")
        else:
            folder, json_path = os.path.dirname(tokenizer_path) or ".", tokenizer_path
        if not os.path.isfile(json_path):
            raise FileNotFoundError(f"--tokenizer-model {tokenizer_path!r}: no {json_path} (give a folder with "
                                    "tokenizer.json, or the tokenizer.json file; nothing is downloaded)")
        super().__init__(tokenizer_path=os.path.abspath(json_path), include_special_tokens=include_special_tokens,
                         additional_special_tokens=list(additional_special_tokens or []))
        self._tokenizer = tokenizers.Tokenizer.from_file(json_path)
        self.include_special_tokens = include_special_tokens

        config = _read_json(os.path.join(folder, "special_tokens_map.json"))
        config.update(_read_json(os.path.join(folder, "tokenizer_config.json")))
        # tokenizer_config.json may declare added tokens that tokenizer.json lacks.
        declared = config.get("added_tokens_decoder") or {}
        for _, entry in sorted(declared.items(), key=lambda kv: int(kv[0])):
            content = _token_text(entry)
            if content is not None and self._tokenizer.token_to_id(content) is None:
                self._tokenizer.add_special_tokens([tokenizers.AddedToken(content, special=True)])
        self.special: Dict[str, Optional[str]] = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        # Megatron's fallbacks: eos from sep, and bos/cls from each other.
        if self.special["eos_token"] is None and self.special["sep_token"]:
            self.special["eos_token"] = self.special["sep_token"]
        if self.special["bos_token"] is None and self.special["cls_token"]:
            self.special["bos_token"] = self.special["cls_token"]
        extra = [t for t in (additional_special_tokens or [])]
        missing = [t for t in list(self.special.values()) + extra
                   if t is not None and self._tokenizer.token_to_id(t) is None]
        if missing:
            self._tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in missing])
        self.additional_special_tokens_ids = [self._tokenizer.token_to_id(t) for t in extra]

    def _id(self, name: str) -> Optional[int]:
        token = self.special.get(name)
        return None if token is None else self._tokenizer.token_to_id(token)

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=self.include_special_tokens).ids

    def detokenize(self, ids: List[int], skip_special_tokens: Optional[bool] = None) -> str:
        if skip_special_tokens is None:
            skip_special_tokens = not self.include_special_tokens
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def eod(self) -> Optional[int]:
        return self._id("eos_token")

    @property
    def eos(self) -> Optional[int]:
        return self._id("eos_token")

    @property
    def bos(self) -> Optional[int]:
        return self._id("bos_token")

    @property
    def pad(self) -> Optional[int]:
        return self._id("pad_token")

    @property
    def unk(self) -> Optional[int]:
        return self._id("unk_token")
