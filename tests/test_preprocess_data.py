"""tools/preprocess_data.py end to end with each tokenizer; 1 vs 2 workers; partitions; errors."""

import contextlib
import gzip
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_fsdp.datasets.indexed_dataset import IndexedDataset
from test_tokenizer import needs_tokenizers, tiny_gpt2_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


_spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
preprocess_data = importlib.util.module_from_spec(_spec)
sys.modules["preprocess_data"] = preprocess_data  # so that --workers > 1 can pickle Encoder.encode in run()
_spec.loader.exec_module(preprocess_data)


def run(*args, check=True):
    """The tool's main() in this process (a fresh interpreter per call costs seconds); stderr captured."""
    err, code = io.StringIO(), 0
    with contextlib.redirect_stderr(err):
        try:
            preprocess_data.main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
            if not isinstance(exit_.code, int):
                print(exit_.code, file=err)
    proc = SimpleNamespace(returncode=code, stderr=err.getvalue())
    if check and proc.returncode != 0:
        raise AssertionError(f"preprocess_data failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def read(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.document_indices.tolist(), ds.index.dtype


def write_jsonl(path, records):
    # U+2028 inside a text must not split the line (Megatron reads with `for line in file`).
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


NULL_DOCS = [{"text": "1 2 3"}, {"text": ["4 5", "", "6"]}, {"text": ""}, {"text": ["7"]}, {"text": "8 9"}]


def test_null_tokenizer_end_to_end(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", NULL_DOCS)
    proc = run("--input", src, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "100", "--append-eod", "--workers", "1", "--log-interval", "2")
    seqs, doc_index, dtype = read(str(tmp_path / "out_text_document"))
    # A list is one sequence per element; empty ones are dropped; eod (99) ends a non-empty document;
    # the empty document still counts (its document-index entry repeats).
    assert seqs == [[1, 2, 3, 99], [4, 5], [6, 99], [7, 99], [8, 9, 99]]
    assert doc_index == [0, 1, 3, 3, 4, 5]
    assert dtype == np.uint16
    assert "Processed 2 documents (" in proc.stderr and "docs/s" in proc.stderr and "MB/s)." in proc.stderr


def test_gpt2_end_to_end_and_workers_give_identical_bytes(tmp_path):
    vocab, merges = tiny_gpt2_files(tmp_path)
    # "meta" is not tokenized: its raw U+2028 only checks that lines are not split there.
    records = [{"text": t, "other": "hello", "meta": "x\u2028y"} for t in
               ["hello world", "hell<|endoftext|>hello", "it's 42\n", "hello  world", "a  b"] * 30]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    outputs = []
    for workers in ("1", "2"):
        prefix = str(tmp_path / f"w{workers}")
        run("--input", src, "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", workers,
            "--json-keys", "text", "other")
        outputs.append({f"{key}.{ext}": open(f"{prefix}_{key}_document.{ext}", "rb").read()
                        for key in ("text", "other") for ext in ("bin", "idx")})
    assert outputs[0] == outputs[1]
    seqs, doc_index, _ = read(str(tmp_path / "w1_text_document"))
    assert len(doc_index) == 151
    assert seqs[0] == [99, 104, 105] and seqs[1] == [98, 105, 99, 105]
    assert 95 in seqs[2]  # the newline
    assert read(str(tmp_path / "w1_other_document"))[0][0] == [99, 105]


@needs_tokenizers
def test_huggingface_end_to_end(tmp_path):
    from test_tokenizer import _hf_folder

    folder = _hf_folder(tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world"}, {"text": "world !"}])
    run("--input", src, "--output-prefix", str(tmp_path / "hf"), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(folder), "--append-eod", "--workers", "1")
    assert read(str(tmp_path / "hf_text_document"))[0] == [[1, 3, 4, 2], [1, 4, 5, 2]]


@pytest.mark.parametrize("sequential", [True, False])
def test_partitions_merge_in_partition_order(tmp_path, sequential):
    docs = [{"text": f"{i} {i + 1}"} for i in range(0, 40, 2)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    common = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    run("--input", src, "--output-prefix", str(tmp_path / "one"), "--workers", "1", *common)
    extra = ["--keep-sequential-samples"] if sequential else []
    run("--input", str(tmp_path / "in*.jsonl"), "--output-prefix", str(tmp_path / "two"), "--workers", "2",
        "--partitions", "2", *extra, *common)
    one, two = read(str(tmp_path / "one_text_document")), read(str(tmp_path / "two_text_document"))
    if sequential:
        assert one == two
    else:  # lines are dealt round-robin: partition 0 holds the even lines, partition 1 the odd ones
        assert two[0] == one[0][0::2] + one[0][1::2]
    # Megatron names partition files after --input (glob characters included) and keeps them.
    assert os.path.exists(tmp_path / "in*_0.jsonl") and os.path.exists(tmp_path / "two_1_text_document.idx")
    # Everything is written under a temporary name and renamed into place: nothing temporary is left.
    assert not [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]


@pytest.mark.parametrize("records,flags,match", [
    ([{"text": "1 2"}, {"txt": "3"}], [], r"in.jsonl:2: no key 'text'"),
    ([{"text": "1 2"}, {"text": "3 500"}], [], r"in.jsonl:2: 'text': token id 500 is outside the tokenizer's "
                                              r"vocabulary \[0, 100\)"),
    ([{"text": 5}], [], "must be a string or a list of strings"),
    ([{"text": "1"}], ["--workers", "3", "--partitions", "2"], "must be a multiple of --partitions"),
    ([{"text": "1"}], ["--tokenizer-type", "GPT2BPETokenizer"], "needs --vocab-file"),
])
def test_bad_input_is_one_clear_error(tmp_path, records, flags, match):
    src = write_jsonl(tmp_path / "in.jsonl", records)
    args = ["--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100", "--workers", "1"]
    proc = run(*args, *flags, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(match, proc.stderr), proc.stderr


def test_split_sentences_needs_nltk(tmp_path):
    if importlib.util.find_spec("nltk") is not None:
        pytest.skip("nltk is installed; this checks the error shown without it")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}])
    proc = run("--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "100", "--workers", "1", "--split-sentences", check=False)
    assert proc.returncode != 0 and "--split-sentences needs the nltk package" in proc.stderr


@pytest.mark.parametrize("keep_newlines", [False, True])
def test_split_sentences_with_nltk(tmp_path, monkeypatch, keep_newlines):
    """Runs where nltk is installed: an empty punkt model (no abbreviations) splits at every period."""
    nltk = pytest.importorskip("nltk", reason="the optional nltk package is not installed")
    model = tmp_path / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    model.mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (model / name).write_text("")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data")] + list(nltk.data.path))
    vocab, merges = tiny_gpt2_files(tmp_path)
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "hello world.\nhello"}, {"text": "hell"}])
    run("--input", src, "--output-prefix", str(tmp_path / "s"), "--tokenizer-type", "GPT2BPETokenizer",
        "--vocab-file", vocab, "--merge-file", merges, "--workers", "1", "--split-sentences", "--append-eod",
        *(["--keep-newlines"] if keep_newlines else []))
    seqs, doc_index, _ = read(str(tmp_path / "s_text_sentence"))
    first = [99, 104, ord(".") - 33] + ([95] if keep_newlines else [])  # 95 is the newline
    assert seqs == [first, [99, 105], [98, 105]] and doc_index == [0, 2, 3]


def test_failed_run_leaves_no_partial_output(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}, {"text": "oops"}])
    proc = run("--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "NullTokenizer",
               "--vocab-size", "100", "--workers", "1", check=False)
    assert proc.returncode != 0 and "in.jsonl:2" in proc.stderr
    assert not any(p.name.startswith("o_") for p in tmp_path.iterdir())


NULL_FLAGS = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
ONE_WORKER, TWO_WORKERS = ["--workers", "1"], ["--workers", "2"]
TWO_PARTITIONS = ["--workers", "2", "--partitions", "2"]


def _assert_one_error_line(proc, pattern):
    """Exit code 1 (as every input error), one `error:` line matching `pattern`, no traceback."""
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(pattern, errors[0]), errors[0]


def _write_non_utf8(path):
    """Five good lines, then (line 6) a 0xff byte 13 bytes in, after a 2-byte "é"; gzipped for .gz."""
    good = "".join(json.dumps({"text": f"{i} {i}"}) + "\n" for i in range(5)).encode()
    data = good + b'{"text": "\xc3\xa9 \xff 1"}\n' + good
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return str(path)


@pytest.mark.parametrize("name,flags", [("in.jsonl", ONE_WORKER), ("in.jsonl", TWO_WORKERS),
                                        ("in.jsonl", TWO_PARTITIONS), ("in.jsonl.gz", ONE_WORKER)])
def test_a_byte_that_is_not_utf8_is_one_error_naming_file_line_and_offset(tmp_path, name, flags):
    src = _write_non_utf8(tmp_path / name)
    proc = run("--input", src, "--output-prefix", str(tmp_path / "o"), *NULL_FLAGS, *flags, check=False)
    _assert_one_error_line(proc, re.escape(f"{src}:6: byte 0xff at byte offset 13 of the line is not valid "
                                           "UTF-8"))
    # No output, no partition file (checked while dealing lines), nothing temporary.
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.e2e
def test_a_byte_that_is_not_utf8_from_the_command_line(tmp_path):
    src = _write_non_utf8(tmp_path / "in.jsonl")
    proc = subprocess.run([sys.executable, TOOL, "--input", src, "--output-prefix", str(tmp_path / "o"),
                           *NULL_FLAGS, *TWO_WORKERS], capture_output=True, text=True, cwd=ROOT, timeout=300)
    _assert_one_error_line(proc, r"in\.jsonl:6: byte 0xff at byte offset 13 of the line is not valid UTF-8")


@pytest.mark.parametrize("flags", [ONE_WORKER, TWO_PARTITIONS])
@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_an_input_with_no_document_is_refused_and_writes_nothing(tmp_path, content, flags):
    previous = write_jsonl(tmp_path / "previous.jsonl", [{"text": "1 2"}])
    run("--input", previous, "--output-prefix", str(tmp_path / "o"), *NULL_FLAGS, *ONE_WORKER)
    kept = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    (tmp_path / "in.jsonl").write_text(content)
    proc = run("--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"), *NULL_FLAGS, *flags,
               check=False)
    _assert_one_error_line(proc, r"no documents found in \S*in\.jsonl \(it is empty or holds only blank lines\)")
    # The previous output is untouched; no empty pair, no partition file, nothing temporary.
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "in.jsonl"} == kept


@pytest.mark.parametrize("flags", [ONE_WORKER, TWO_WORKERS, TWO_PARTITIONS])
@pytest.mark.parametrize("records,keys,empty", [
    ([{"text": ""}, {"text": [""]}, {"text": []}], ["text"], "text"),
    ([{"text": "1", "title": ""}, {"text": "2", "title": [""]}], ["text", "title"], "title"),
])
def test_documents_without_any_token_are_refused(tmp_path, records, keys, empty, flags):
    src = write_jsonl(tmp_path / "in.jsonl", records)
    proc = run("--input", src, "--output-prefix", str(tmp_path / "o"), "--json-keys", *keys, "--append-eod",
               *NULL_FLAGS, *flags, check=False)
    _assert_one_error_line(proc, rf"in\.jsonl: all {len(records)} documents are empty under --json-keys {empty} "
                                 r"\(every text tokenizes to no tokens\); nothing was written")
    # Not even the partitions' .bin/.idx (the partition .jsonl files are kept, as Megatron keeps them).
    assert not [p.name for p in tmp_path.iterdir() if p.suffix in (".bin", ".idx") or ".tmp" in p.name]


def test_one_empty_partition_of_several_is_fine(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}])  # partition 1 gets no line
    run("--input", src, "--output-prefix", str(tmp_path / "o"), *NULL_FLAGS, *TWO_PARTITIONS)
    assert read(str(tmp_path / "o_text_document"))[:2] == ([[1, 2]], [0, 1])


def test_partitions_of_a_gzipped_input(tmp_path):
    """Partition files are plain text even when named after a .gz input (as Megatron writes them)."""
    docs = [{"text": f"{i} {i + 1}"} for i in range(10)]
    src = tmp_path / "in.jsonl.gz"
    src.write_bytes(gzip.compress("".join(json.dumps(d) + "\n" for d in docs).encode()))
    run("--input", str(src), "--output-prefix", str(tmp_path / "one"), *NULL_FLAGS, *ONE_WORKER)
    run("--input", str(src), "--output-prefix", str(tmp_path / "two"), *NULL_FLAGS, *TWO_PARTITIONS,
        "--keep-sequential-samples")
    assert read(str(tmp_path / "one_text_document")) == read(str(tmp_path / "two_text_document"))
