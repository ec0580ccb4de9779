"""tools/stdlib_corpus.py: the README's offline corpus and byte-level GPT-2 vocabulary. Its main()
runs in this process (scripts/pretrain_gpt_stdlib.sh runs it as a command)."""

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_fsdp.training.tokenizer.gpt2_bpe_tokenizer import GPT2BPETokenizer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("stdlib_corpus", ROOT / "tools" / "stdlib_corpus.py")
stdlib_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stdlib_corpus)


def test_corpus_and_byte_vocabulary(tmp_path, capsys):
    assert stdlib_corpus.main(["--output-dir", str(tmp_path), "--max-megabytes", "0.2"]) == 0
    assert capsys.readouterr().out.startswith("wrote ")
    docs = [json.loads(line) for line in (tmp_path / "stdlib.jsonl").read_text().splitlines()]
    assert docs and all(d["text"].strip() and d["path"].endswith(".py") for d in docs)
    assert [d["path"] for d in docs] == sorted(d["path"] for d in docs)
    assert sum(len(d["text"].encode()) for d in docs) <= 0.2 * 2 ** 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["byte-merges.txt", "byte-vocab.json", "stdlib.jsonl"]

    tokenizer = GPT2BPETokenizer(str(tmp_path / "byte-vocab.json"), str(tmp_path / "byte-merges.txt"))
    assert tokenizer.vocab_size == 257 and tokenizer.eod == 256
    text = docs[0]["text"][:500] + " ünïcode ✓<|endoftext|>"
    ids = tokenizer.tokenize(text)
    assert len(ids) == len(text.encode()) - len("<|endoftext|>") + 1  # one token per byte, eod one token
    assert tokenizer.detokenize(ids) == text


def test_bad_size_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        stdlib_corpus.main(["--output-dir", str(tmp_path), "--max-megabytes", "0"])
    assert stop.value.code == 2 and "--max-megabytes must be positive, got 0.0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
