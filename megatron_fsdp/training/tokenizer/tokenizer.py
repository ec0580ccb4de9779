"""`build_tokenizer(args)` and the tokenizer flags (Megatron-LM's names and defaults)."""

from __future__ import annotations

import argparse
import logging
import math

from megatron_fsdp.training.tokenizer.base import MegatronTokenizer
from megatron_fsdp.utils import reject_unsupported

logger = logging.getLogger(__name__)

SUPPORTED_TOKENIZERS = ("NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer")
# Megatron's other types: named so that asking for one says "not supported" rather than "unknown".
MEGATRON_TOKENIZERS = SUPPORTED_TOKENIZERS + (
    "BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
    "Llama2Tokenizer", "TikTokenizer", "MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")


def _add_tokenizer_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's tokenizer flags (`megatron.training.arguments._add_tokenizer_args`)."""
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, default=None, choices=MEGATRON_TOKENIZERS,
                       help="What type of tokenizer to use.")
    group.add_argument("--vocab-size", type=int, default=None, help="Size of vocab before EOD or padding.")
    group.add_argument("--padded-vocab-size", type=int, default=None,
                       help="Vocabulary size of the model (padded); computed when not given.")
    group.add_argument("--vocab-file", type=str, default=None, help="Path to the vocab file.")
    group.add_argument("--merge-file", type=str, default=None, help="Path to the BPE merge file.")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="Number of additional vocabulary tokens (T5 span masking; must be 0 here).")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="HuggingFaceTokenizer: a local folder with tokenizer.json, or a tokenizer.json path.")
    group.add_argument("--tokenizer-metadata", dest="metadata_path", type=str, default=None,
                       help="Path to a tokenizer metadata file (not supported).")
    group.add_argument("--tokenizer-special-tokens", dest="special_tokens", nargs="+", default=None,
                       help="Additional special tokens.")
    group.add_argument("--tokenizer-hf-no-use-fast", action="store_true",
                       help="Use a slow Hugging Face tokenizer (not supported: ids come from `tokenizers`).")
    group.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: do not add the post-processor's special tokens (a BOS).")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="Allow a tokenizer to run remote code (not supported).")
    group.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                       help="EOD token id for NullTokenizer. Defaults to vocab_size - 1.")
    group.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                       help="Pad token id for NullTokenizer. Defaults to -1 (no pad token).")
    group.add_argument("--chat-template", type=str, default=None, help="Chat template (not supported).")
    group.add_argument("--tiktoken-pattern", type=str, default=None, help="TikTokenizer only (not supported).")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer only (not supported).")
    return parser


def build_tokenizer(args, **kwargs) -> MegatronTokenizer:
    """The tokenizer `args.tokenizer_type` names, from local files only; sets `args.padded_vocab_size`
    (vocabulary padded to a multiple of make_vocab_size_divisible_by x TP) when it is None."""
    tokenizer_type = getattr(args, "tokenizer_type", None)
    if tokenizer_type not in SUPPORTED_TOKENIZERS:
        raise ValueError(f"--tokenizer-type {tokenizer_type} is not supported by megatron_fsdp "
                         f"(supported: {', '.join(SUPPORTED_TOKENIZERS)})")
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    reject_unsupported(f"--tokenizer-type {tokenizer_type}", {
        "--vocab-extra-ids": (get("vocab_extra_ids", 0), 0, "T5 sentinel tokens are not part of GPT pretraining"),
        "--tokenizer-metadata": (get("metadata_path"), None),
        "--tokenizer-hf-no-use-fast": (get("tokenizer_hf_no_use_fast", False), False,
                                       "ids come from the `tokenizers` package (a fast tokenizer)"),
        "--trust-remote-code": (get("trust_remote_code", False), False, "tokenizers load from local files only"),
        "--chat-template": (get("chat_template"), None),
        "--tiktoken-pattern": (get("tiktoken_pattern"), None),
    }, error=ValueError)
    special_tokens = get("special_tokens") or []

    if tokenizer_type == "NullTokenizer":
        from megatron_fsdp.training.tokenizer.null_tokenizer import NullTokenizer

        if get("vocab_size") is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        reject_unsupported("--tokenizer-type NullTokenizer", {
            "--tokenizer-special-tokens": (get("special_tokens"), None)}, error=ValueError)
        tokenizer = NullTokenizer(get("vocab_size"), eod_id=get("null_tokenizer_eod_id"),
                                  pad_id=get("null_tokenizer_pad_id", -1))
    elif tokenizer_type == "GPT2BPETokenizer":
        from megatron_fsdp.training.tokenizer.gpt2_bpe_tokenizer import GPT2BPETokenizer

        tokenizer = GPT2BPETokenizer(get("vocab_file"), get("merge_file"), additional_special_tokens=special_tokens)
    else:
        from megatron_fsdp.training.tokenizer.huggingface_tokenizer import HuggingFaceTokenizer

        if not get("tokenizer_model"):
            raise ValueError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model "
                             "(a local folder with tokenizer.json, or a tokenizer.json path)")
        reject_unsupported("--tokenizer-type HuggingFaceTokenizer", {
            "--vocab-file": (get("vocab_file"), None, "the vocabulary comes from tokenizer.json"),
            "--merge-file": (get("merge_file"), None, "the merges come from tokenizer.json"),
        }, error=ValueError)
        tokenizer = HuggingFaceTokenizer(get("tokenizer_model"),
                                         include_special_tokens=not get("tokenizer_hf_no_include_special_tokens",
                                                                        False),
                                         additional_special_tokens=special_tokens)

    if get("pad_vocab_size", True) and get("make_vocab_size_divisible_by") is not None \
            and get("padded_vocab_size") is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def vocab_size_with_padding(orig_vocab_size: int, args, logging_enabled: bool = True) -> int:
    """Pad the vocabulary to a multiple of make_vocab_size_divisible_by x tensor_model_parallel_size."""
    multiple = args.make_vocab_size_divisible_by * getattr(args, "tensor_model_parallel_size", 1)
    after = int(math.ceil(orig_vocab_size / multiple) * multiple)
    if logging_enabled and getattr(args, "rank", 0) == 0:
        logger.info(f" > padded vocab (size: {orig_vocab_size}) with {after - orig_vocab_size} dummy tokens "
                    f"(new size: {after})")
    return after
