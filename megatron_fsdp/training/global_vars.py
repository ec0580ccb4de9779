"""The process-wide values Megatron-LM's training scripts read: the parsed
arguments and the tokenizer (`get_args()`, `get_tokenizer()`).

Only these two: a model provider, forward step or dataset provider written
for Megatron-LM takes no other parameters, so it reads them from here.
Everything else the training loop needs is passed explicitly.
"""

from __future__ import annotations

import argparse
from typing import Optional

_GLOBAL_ARGS: Optional[argparse.Namespace] = None
_GLOBAL_TOKENIZER = None


def get_args() -> argparse.Namespace:
    if _GLOBAL_ARGS is None:
        raise RuntimeError("arguments are not set: pretrain() (or set_args) sets them")
    return _GLOBAL_ARGS


def set_args(args: Optional[argparse.Namespace]) -> None:
    global _GLOBAL_ARGS
    _GLOBAL_ARGS = args


def get_tokenizer():
    if _GLOBAL_TOKENIZER is None:
        raise RuntimeError("the tokenizer is not built: pretrain() builds it from --tokenizer-type")
    return _GLOBAL_TOKENIZER


def set_tokenizer(tokenizer) -> None:
    global _GLOBAL_TOKENIZER
    _GLOBAL_TOKENIZER = tokenizer


def destroy_global_vars() -> None:
    set_args(None)
    set_tokenizer(None)
