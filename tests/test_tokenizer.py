"""Tokenizers by Megatron's names: NullTokenizer, GPT2BPETokenizer from two local files,
HuggingFaceTokenizer from a local tokenizer.json (needs the optional `tokenizers` package)."""

import json
import random
from types import SimpleNamespace

import pytest

from megatron_fsdp.training.tokenizer import build_tokenizer, vocab_size_with_padding
from megatron_fsdp.training.tokenizer.gpt2_tokenization import bytes_to_unicode, gpt2_pattern

try:
    import tokenizers
except ImportError:
    tokenizers = None

needs_tokenizers = pytest.mark.skipif(tokenizers is None, reason="the optional `tokenizers` package is not installed")

# A tiny GPT-2 vocabulary: printable ASCII as itself, space as "Ġ", newline as "Ċ" (GPT-2's byte map).
ASCII = {chr(c): c - 33 for c in range(33, 127)}
MERGED = ["he", "hel", "hell", "hello", "Ġw", "Ġwo", "Ġwor", "Ġworl", "Ġworld"]
MERGES = ["h e", "he l", "hel l", "hell o", "Ġ w", "Ġw o", "Ġwo r", "Ġwor l", "Ġworl d"]


def tiny_gpt2_files(path):
    vocab = dict(ASCII)
    vocab["Ġ"], vocab["Ċ"] = 94, 95
    for i, token in enumerate(MERGED):
        vocab[token] = 96 + i
    vocab["<|endoftext|>"] = 105
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    return str(path / "vocab.json"), str(path / "merges.txt")


def _args(**kw):
    base = dict(tokenizer_type=None, vocab_size=None, vocab_file=None, merge_file=None, tokenizer_model=None,
                make_vocab_size_divisible_by=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_null_tokenizer():
    tok = build_tokenizer(_args(tokenizer_type="NullTokenizer", vocab_size=100))
    assert tok.tokenize("5 17 99") == [5, 17, 99] and tok.detokenize([5, 17]) == "5 17"
    assert (tok.vocab_size, tok.eod, tok.pad) == (100, 99, -1)
    tok = build_tokenizer(_args(tokenizer_type="NullTokenizer", vocab_size=100, null_tokenizer_eod_id=0))
    assert tok.eod == 0
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("hello")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer(_args(tokenizer_type="NullTokenizer"))


def test_gpt2_bpe_from_local_files(tmp_path):
    vocab, merges = tiny_gpt2_files(tmp_path)
    tok = build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    o = lambda ch: ord(ch) - 33  # noqa: E731
    assert tok.tokenize("hello world") == [99, 104]
    assert tok.tokenize("hello<|endoftext|>hell") == [99, 105, 98]
    assert tok.tokenize("it's 42") == [o("i"), o("t"), o("'"), o("s"), 94, o("4"), o("2")]
    assert tok.tokenize("a  b\nc") == [o("a"), 94, 94, o("b"), 95, o("c")]
    assert (tok.vocab_size, tok.eod, tok.pad) == (106, 105, None)
    assert tok.detokenize(tok.tokenize("hello world\n it's")) == "hello world\n it's"
    with pytest.raises(ValueError, match="do not belong together"):
        tok.tokenize("é")  # its bytes are not in this tiny vocabulary


def test_gpt2_pretokenization_pattern():
    assert gpt2_pattern().findall("Hello, wörld! 123 \u0663x  y\u2003z") == \
        ["Hello", ",", " wörld", "!", " 123", " \u0663", "x", " ", " y", "\u2003", "z"]
    assert gpt2_pattern().findall("we'll they're  \n") == ["we", "'ll", " they", "'re", "  \n"]


@needs_tokenizers
def test_gpt2_bpe_equals_the_tokenizers_library(tmp_path):
    """GPT-2's byte-level BPE as the `tokenizers` library builds it from the same two files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # The 256 byte symbols; `tokenizers` maps bytes the same way, or nothing below would match.
    full = {ch: i for i, ch in enumerate(sorted(bytes_to_unicode().values()))}
    merges = ["h e", "l l", "Ġ t", "Ġt h", "Ġth e", "e r", "i n", "Ġ a", "o n", "Ġ 1", "2 3"]
    for merge in merges:
        full.setdefault(merge.replace(" ", ""), len(full))
    full["<|endoftext|>"] = len(full)
    (tmp_path / "vocab.json").write_text(json.dumps(full))
    (tmp_path / "merges.txt").write_text("\n".join(merges) + "\n")
    ours = build_tokenizer(_args(tokenizer_type="GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                 merge_file=str(tmp_path / "merges.txt")))
    theirs = Tokenizer(models.BPE.from_file(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")))
    theirs.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    theirs.decoder = decoders.ByteLevel()
    theirs.add_special_tokens(["<|endoftext|>"])
    rng = random.Random(0)
    alphabet = "the hell inner on a 123 'll 's\n\t  ,.!?éü中文ß\u2003<|endoftext|>"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert ours.tokenize(text) == theirs.encode(text).ids, text


def _hf_folder(tmp_path, with_config=True):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "!": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    if with_config:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "unk_token": "<unk>"}))
    return tmp_path


@needs_tokenizers
def test_huggingface_tokenizer_from_a_local_folder(tmp_path):
    folder = _hf_folder(tmp_path)
    tok = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder)))
    assert tok.tokenize("hello world !") == [1, 3, 4, 5]  # the post-processor's BOS included, as Megatron
    assert (tok.vocab_size, tok.eod, tok.bos, tok.pad) == (6, 2, 1, None)
    plain = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder / "tokenizer.json"),
                                  tokenizer_hf_no_include_special_tokens=True))
    assert plain.tokenize("hello world !") == [3, 4, 5]
    extra = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(folder),
                                  special_tokens=["<extra>"]))
    assert extra.vocab_size == 7 and extra.additional_special_tokens_ids == [6]


@needs_tokenizers
def test_huggingface_tokenizer_without_config_has_no_eod(tmp_path):
    tok = build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer",
                                tokenizer_model=str(_hf_folder(tmp_path, with_config=False))))
    assert tok.eod is None


@pytest.mark.skipif(tokenizers is not None, reason="checks the error shown without the `tokenizers` package")
def test_huggingface_tokenizer_without_the_package_is_a_clear_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ImportError, match="needs the `tokenizers` package"):
        build_tokenizer(_args(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))


@pytest.mark.parametrize("kw,error,match", [
    (dict(tokenizer_type="SentencePieceTokenizer"), ValueError, "not supported by megatron_fsdp"),
    (dict(tokenizer_type="GPT2BPETokenizer"), ValueError, "needs --vocab-file"),
    (dict(tokenizer_type="GPT2BPETokenizer", vocab_file="/nonexistent/vocab.json", merge_file="/x"),
     FileNotFoundError, "--vocab-file /nonexistent/vocab.json does not exist"),
    (dict(tokenizer_type="HuggingFaceTokenizer"), ValueError, "needs --tokenizer-model"),
    (dict(tokenizer_type="NullTokenizer", vocab_size=10, vocab_extra_ids=5), ValueError, "--vocab-extra-ids=5"),
    (dict(tokenizer_type="NullTokenizer", vocab_size=10, trust_remote_code=True), ValueError, "--trust-remote-code"),
])
def test_bad_tokenizer_flags_are_clear_errors(kw, error, match):
    with pytest.raises(error, match=match):
        build_tokenizer(_args(**kw))


def test_padded_vocab_size_follows_megatron():
    args = _args(tokenizer_type="NullTokenizer", vocab_size=50257, make_vocab_size_divisible_by=128,
                 tensor_model_parallel_size=2, padded_vocab_size=None)
    build_tokenizer(args)
    assert args.padded_vocab_size == 50432  # ceil(50257 / 256) * 256
    assert vocab_size_with_padding(100, SimpleNamespace(make_vocab_size_divisible_by=64,
                                                        tensor_model_parallel_size=1)) == 128
