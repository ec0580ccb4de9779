"""GPT-2's byte-level BPE from `vocab.json` and `merges.txt` alone, in plain Python.

Megatron-Core 0.19 loads `GPT2BPETokenizer` through `transformers.AutoTokenizer("gpt2", ...)`,
which needs the `transformers` package and the hub name even with local files. This reads the
two files and nothing else, and gives the ids of GPT-2's tokenizer:

- text is first split on the special tokens (`<|endoftext|>`), which map to their own ids;
- each remaining piece is split by GPT-2's pre-tokenization pattern (contractions, letters,
  numbers, other symbols, whitespace), each part's UTF-8 bytes are mapped to printable
  characters, and the BPE merges are applied by rank.

The pattern needs Unicode letter/number classes (`\\p{L}`, `\\p{N}`) that Python's `re` lacks;
they are built here from `unicodedata`, so the result follows this Python's Unicode tables.
"""

from __future__ import annotations

import json
import re
import unicodedata
from functools import lru_cache
from typing import Dict, Iterable, List, Tuple


@lru_cache(maxsize=1)
def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


# Letters and numbers live in planes 0-3; planes 4-13 are unassigned and 14-16 hold only format,
# mark and private-use characters, so scanning past here finds none (and would take 4x longer).
_LAST_CODE_POINT_WITH_LETTERS = 0x3FFFF


def _char_class(predicate) -> str:
    """A regex character class body of every code point that satisfies `predicate`, as ranges."""
    parts, start, prev = [], None, None
    for cp in range(_LAST_CODE_POINT_WITH_LETTERS + 1):
        if predicate(cp):
            if start is None:
                start = cp
            prev = cp
        elif start is not None:
            parts.append(_range(start, prev))
            start = None
    if start is not None:
        parts.append(_range(start, prev))
    return "".join(parts)


def _range(a: int, b: int) -> str:
    return re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"


@lru_cache(maxsize=1)
def gpt2_pattern() -> "re.Pattern[str]":
    """`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`."""
    letters = _char_class(lambda cp: unicodedata.category(chr(cp)).startswith("L"))
    numbers = _char_class(lambda cp: unicodedata.category(chr(cp)).startswith("N"))
    # Unicode White_Space (what the regex module and Rust's regex call \s); Python's \s differs on \x1c-\x1f.
    space = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
    return re.compile(
        rf"""'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{numbers}]+| ?[^{space}{letters}{numbers}]+"""
        rf"""|[{space}]+(?![^{space}])|[{space}]+""")


def _pairs(word: Tuple[str, ...]):
    return set(zip(word[:-1], word[1:]))


class GPT2Tokenizer:
    """Byte-level BPE: `encode(text) -> ids`, `decode(ids) -> text`."""

    def __init__(self, vocab_file: str, merges_file: str, special_tokens: Iterable[str] = ("<|endoftext|>",),
                 errors: str = "replace") -> None:
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: Dict[str, int] = json.load(f)
        if not isinstance(self.encoder, dict) or not all(isinstance(v, int) for v in self.encoder.values()):
            raise ValueError(f"{vocab_file} is not a GPT-2 vocab.json (a JSON object of token -> id)")
        self.decoder = {v: k for k, v in self.encoder.items()}
        with open(merges_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        merges = [tuple(line.split()) for line in lines if line.strip()]
        bad = [m for m in merges if len(m) != 2]
        if bad:
            raise ValueError(f"{merges_file}: every merge line must hold two symbols, got {bad[0]!r}")
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.errors = errors
        self.pattern = gpt2_pattern()
        self.special_tokens: Dict[str, int] = {}
        for token in special_tokens:
            self.add_special_token(token)
        self._cache: Dict[str, List[int]] = {}

    def add_special_token(self, token: str) -> int:
        """A token matched verbatim in text; appended to the vocabulary when it is new."""
        if token not in self.encoder:
            new_id = max(self.decoder, default=-1) + 1
            self.encoder[token] = new_id
            self.decoder[new_id] = token
        self.special_tokens[token] = self.encoder[token]
        # Longest first, so a special token that contains another wins.
        alternatives = sorted(self.special_tokens, key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(re.escape(t) for t in alternatives) + ")")
        return self.encoder[token]

    def bpe(self, token: str) -> Tuple[str, ...]:
        word = tuple(token)
        pairs = _pairs(word)
        while pairs:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            merged, i = [], 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    merged.extend(word[i:])
                    break
                merged.extend(word[i:j])
                i = j
                if i < len(word) - 1 and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
            if len(word) == 1:
                break
            pairs = _pairs(word)
        return word

    def _encode_piece(self, piece: str) -> List[int]:
        ids = self._cache.get(piece)
        if ids is None:
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            try:
                ids = [self.encoder[t] for t in self.bpe(mapped)]
            except KeyError as err:
                raise ValueError(f"GPT-2 vocabulary has no token {err.args[0]!r} (from {piece!r}): "
                                 "vocab.json and merges.txt do not belong together") from None
            if len(self._cache) < 500_000:
                self._cache[piece] = ids
        return ids

    def encode(self, text: str) -> List[int]:
        ids: List[int] = []
        for chunk in self._special_split.split(text) if self.special_tokens else [text]:
            if not chunk:
                continue
            special = self.special_tokens.get(chunk)
            if special is not None:
                ids.append(special)
                continue
            for piece in self.pattern.findall(chunk):
                ids.extend(self._encode_piece(piece))
        return ids

    def decode(self, ids: List[int]) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        out, buffer = [], bytearray()
        for ch in text:
            byte = self.byte_decoder.get(ch)
            if byte is None:  # a special token's own characters
                out.append(buffer.decode("utf-8", errors=self.errors))
                buffer.clear()
                out.append(ch)
            else:
                buffer.append(byte)
        out.append(buffer.decode("utf-8", errors=self.errors))
        return "".join(out)
