"""Tokenizers by Megatron's `--tokenizer-type` names (`megatron.training.tokenizer`'s place)."""

from megatron_fsdp.training.tokenizer.base import MegatronTokenizer
from megatron_fsdp.training.tokenizer.tokenizer import (
    SUPPORTED_TOKENIZERS,
    _add_tokenizer_args,
    build_tokenizer,
    vocab_size_with_padding,
)

__all__ = ["MegatronTokenizer", "SUPPORTED_TOKENIZERS", "_add_tokenizer_args", "build_tokenizer",
           "vocab_size_with_padding"]
