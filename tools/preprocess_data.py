"""Tokenize a JSON-lines corpus into Megatron's `.bin/.idx` format (Megatron-LM's tool and flags).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2

writes `corpus_text_document.{bin,idx}` (`_sentence` with `--split-sentences`). Each input line
is a JSON object; each `--json-keys` value is a document: a string, or a list of strings (one
sequence each). Empty sequences are dropped; a document with no tokens still counts as a
document. Workers keep the input order, so any `--workers` gives the same bytes. With
`--partitions N`, `--input` is a glob: its lines are dealt to N partition files, each is
tokenized by its own process, and the results are merged in partition order. Progress goes to
stderr: `Processed N documents (X docs/s, Y MB/s).`

Bad input is one error line naming the file and line (bad JSON, a missing key, a byte that is not
UTF-8), exit code 1, and no output. So is an input with no document (blank lines are skipped, where
Megatron fails on them) or whose documents hold no token under a key: training would reject it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import multiprocessing
import os
import re
import sys
import time
from typing import Dict, List, Optional, Tuple

import numpy

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron_fsdp.datasets import indexed_dataset  # noqa: E402
from megatron_fsdp.training.tokenizer import _add_tokenizer_args, build_tokenizer  # noqa: E402

_MAX_SPLIT_CHARS = 1_000_000  # Megatron sentence-splits long texts in chunks of this many characters
# Input is read with errors="surrogateescape": a byte that is not UTF-8 becomes one of these lone
# surrogates (valid UTF-8 never decodes to them), so the line holding it can be named, not only a
# position in the decoder's buffer.
_UNDECODED_BYTE = re.compile("[\udc80-\udcff]")


class _Failure:
    """A worker's error, carried back so the main process can name the input line."""

    def __init__(self, message: str) -> None:
        self.message = message


def _open_text(path: str, gzipped: Optional[bool] = None):
    """Lines as Megatron reads them (`for line in file`, UTF-8); undecodable bytes are kept, see
    _not_utf8, instead of failing the whole read with no line number. `gzipped` defaults to the
    name ending in .gz."""
    if path.endswith(".gz") if gzipped is None else gzipped:
        return gzip.open(path, "rt", encoding="utf-8", errors="surrogateescape")
    return open(path, encoding="utf-8", errors="surrogateescape")


def _not_utf8(line: str) -> Optional[str]:
    """Why `line` (read by _open_text) is not UTF-8 text, or None."""
    match = _UNDECODED_BYTE.search(line)
    if match is None:
        return None
    offset = len(line[:match.start()].encode("utf-8", "surrogateescape"))
    return (f"byte 0x{ord(match.group()) - 0xDC00:02x} at byte offset {offset} of the line is not valid UTF-8; "
            "the input must be UTF-8 text")


def _sentence_splitter(lang: str, keep_newlines: bool):
    try:
        import nltk
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
    except ImportError:
        raise SystemExit("preprocess_data.py: error: --split-sentences needs the nltk package (pip install nltk) "
                         "and its punkt data") from None
    try:
        if hasattr(nltk.tokenize, "PunktTokenizer"):  # nltk >= 3.8.2 reads the pickle-free punkt_tab data
            splitter = nltk.tokenize.PunktTokenizer(lang)
        else:
            splitter = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
    except (LookupError, OSError, ValueError) as err:
        raise SystemExit(f"preprocess_data.py: error: no nltk punkt model for --lang {lang} ({err}); install it "
                         "where NLTK_DATA points, e.g. python -m nltk.downloader punkt_tab") from None
    if not keep_newlines:
        return splitter

    class KeepNewlines(PunktLanguageVars):
        # Punkt's default pattern swallows the whitespace (newlines) after a sentence end.
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                          # whitespace stays with the sentence
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)        # or some other token
            ))"""

    return PunktSentenceTokenizer(train_text=splitter._params, lang_vars=KeepNewlines())


class Encoder:
    """Per-worker state (the tokenizer, the sentence splitter) and the per-line work."""

    def __init__(self, args) -> None:
        self.args = args

    def initializer(self) -> None:
        Encoder.tokenizer = build_tokenizer(self.args)
        Encoder.splitter = _sentence_splitter(self.args.lang, self.args.keep_newlines) \
            if self.args.split_sentences else None
        Encoder.dtype = indexed_dataset.DType.optimal_dtype(Encoder.tokenizer.vocab_size)

    def _sentences(self, text) -> List[str]:
        if isinstance(text, list):
            return text
        if Encoder.splitter is None:
            return [text]
        return [s for i in range(0, len(text), _MAX_SPLIT_CHARS)
                for s in Encoder.splitter.tokenize(text[i:i + _MAX_SPLIT_CHARS])]

    def encode(self, json_line: str):
        """`(ids per key, sequence lengths per key, input bytes)`, or a _Failure."""
        not_utf8 = _not_utf8(json_line)
        if not_utf8 is not None:
            return _Failure(not_utf8)
        nbytes = len(json_line.encode("utf-8"))
        if not json_line.strip():
            return None, None, nbytes
        try:
            data = json.loads(json_line)
        except json.JSONDecodeError as err:
            return _Failure(f"not a JSON object ({err})")
        if not isinstance(data, dict):
            return _Failure(f"a line must hold a JSON object, got {type(data).__name__}")
        vocab_size = Encoder.tokenizer.vocab_size
        ids, lens = {}, {}
        for key in self.args.json_keys:
            if key not in data:
                return _Failure(f"no key {key!r} (keys: {sorted(data)}); choose them with --json-keys")
            text = data[key]
            if not isinstance(text, (str, list)) or isinstance(text, list) and \
                    not all(isinstance(t, str) for t in text):
                return _Failure(f"{key!r} must be a string or a list of strings, got {type(text).__name__}")
            doc_ids: List[int] = []
            sentence_lens: List[int] = []
            for sentence in self._sentences(text):
                try:
                    sentence_ids = Encoder.tokenizer.tokenize(sentence)
                except ValueError as err:
                    return _Failure(f"{key!r}: {err}")
                if len(sentence_ids) > 0:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if doc_ids and self.args.append_eod:
                doc_ids.append(Encoder.tokenizer.eod)
                sentence_lens[-1] += 1
            array = numpy.asarray(doc_ids, dtype=numpy.int64)
            if array.size and (array.min() < 0 or array.max() >= vocab_size):
                return _Failure(f"{key!r}: token id {int(array.min() if array.min() < 0 else array.max())} is "
                                f"outside the tokenizer's vocabulary [0, {vocab_size})")
            ids[key] = array.astype(Encoder.dtype)
            lens[key] = sentence_lens
        return ids, lens, nbytes


def _encode_partition(args, input_path: str, output_prefix: str, workers: int, level: str,
                      partition: bool = False) -> Dict[str, str]:
    """Tokenize one input file into `<output_prefix>_<key>_<level>.{bin,idx}`; returns the prefixes.
    An input with no document, or no token under a key, is refused (_check_not_empty). A
    `partition` of several may be empty (main checks their total), and is plain text even when
    named after a .gz input, as Megatron's are."""
    tokenizer = build_tokenizer(args)
    dtype = indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
    encoder = Encoder(args)
    prefixes = {key: f"{output_prefix}_{key}_{level}" for key in args.json_keys}
    temporary = {key: _temporary(p) for key, p in prefixes.items()}
    builders = {key: indexed_dataset.IndexedDatasetBuilder(indexed_dataset.get_bin_path(p), dtype=dtype)
                for key, p in temporary.items()}
    print(f"Opening {input_path}", file=sys.stderr, flush=True)
    with _open_text(input_path, gzipped=False if partition else None) as fin:
        pool = None
        if workers > 1:
            pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
            encoded = pool.imap(encoder.encode, fin, 32)
        else:
            encoder.initializer()
            encoded = map(encoder.encode, fin)
        start = time.time()
        count = total_bytes = 0
        tokens = {key: 0 for key in args.json_keys}
        try:
            for line_number, result in enumerate(encoded, start=1):
                if isinstance(result, _Failure):
                    raise _input_error(input_path, line_number, result.message)
                doc, sentence_lens, nbytes = result
                total_bytes += nbytes
                if doc is None:  # a blank line
                    continue
                count += 1
                for key in args.json_keys:
                    builders[key].add_document(doc[key], sentence_lens[key])
                    tokens[key] += doc[key].size
                if count % args.log_interval == 0:
                    _report(count, total_bytes, start)
            if not partition:
                _check_not_empty(input_path, count, tokens)
        except BaseException:
            for key, prefix in temporary.items():  # no half-written .bin left behind
                builders[key].data_file.close()
                os.unlink(indexed_dataset.get_bin_path(prefix))
            raise
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    for key, prefix in prefixes.items():
        builders[key].finalize(indexed_dataset.get_idx_path(temporary[key]))
        _publish(temporary[key], prefix)
    elapsed = max(time.time() - start, 1e-9)
    print(f"Done {input_path}: {count} documents, {sum(tokens.values())} tokens in {elapsed:.2f} s "
          f"({count / elapsed:.2f} docs/s, {total_bytes / elapsed / 1024 / 1024:.2f} MB/s).",
          file=sys.stderr, flush=True)
    return prefixes


def _input_error(path: str, line_number: int, message: str) -> SystemExit:
    return SystemExit(f"preprocess_data.py: error: {path}:{line_number}: {message}")


def _check_not_empty(inputs: str, documents: int, tokens: Dict[str, int]) -> None:
    """Refuse a dataset that training would only reject later: no document at all, or a
    --json-keys key under which every document is empty (all its texts tokenize to nothing)."""
    if documents == 0:
        raise SystemExit(f"preprocess_data.py: error: no documents found in {inputs} (it is empty or holds only "
                         "blank lines); nothing was written")
    empty = [key for key, count in tokens.items() if count == 0]
    if empty:
        raise SystemExit(f"preprocess_data.py: error: {inputs}: all {documents} documents are empty under "
                         f"--json-keys {' '.join(empty)} (every text tokenizes to no tokens); nothing was written")


def _temporary(prefix: str) -> str:
    return f"{prefix}.tmp{os.getpid()}"


def _publish(temporary: str, prefix: str) -> None:
    """Move a finished .bin/.idx pair into place. The old .idx goes first and the new one comes
    last, so a run killed at any point leaves a matching pair or no .idx at all (which readers
    report as missing), never a new .bin beside an old .idx."""
    idx, bin_ = indexed_dataset.get_idx_path(prefix), indexed_dataset.get_bin_path(prefix)
    if os.path.exists(idx):
        os.unlink(idx)
    os.replace(indexed_dataset.get_bin_path(temporary), bin_)
    os.replace(indexed_dataset.get_idx_path(temporary), idx)


def _report(count: int, total_bytes: int, start: float) -> None:
    elapsed = max(time.time() - start, 1e-9)
    print(f"Processed {count} documents ({count / elapsed:.2f} docs/s, "
          f"{total_bytes / elapsed / 1024 / 1024:.2f} MB/s).", file=sys.stderr, flush=True)


def _partition_names(args, index: int) -> Tuple[str, str]:
    stem, extension = os.path.splitext(args.input)
    return f"{stem}_{index}{extension}", f"{args.output_prefix}_{index}"


def _write_partitions(args, inputs: List[str]) -> List[Tuple[str, str]]:
    names = [_partition_names(args, i) for i in range(args.partitions)]
    if all(os.path.exists(p) for p, _ in names):
        print(f"Using the existing partition files {names[0][0]} ... (delete them to re-partition)",
              file=sys.stderr, flush=True)
        return names
    partition_size = None
    if args.keep_sequential_samples:
        total = 0
        for path in inputs:
            with _open_text(path) as f:
                total += sum(1 for _ in f)
        partition_size = max(1, math.ceil(total / args.partitions))
    # Each partition is renamed into place only once all are written: the reuse check above
    # never sees a partition a killed run left half-written.
    outs = [open(f"{p}.tmp{os.getpid()}", "w", encoding="utf-8") for p, _ in names]
    try:
        if _deal_lines(args, inputs, outs, partition_size) == 0:
            _check_not_empty(", ".join(inputs), 0, {})
    except BaseException:
        for f in outs:
            f.close()
            os.unlink(f.name)
        raise
    for f, (p, _) in zip(outs, names):
        f.close()
        os.replace(f.name, p)
    return names


def _deal_lines(args, inputs: List[str], outs, partition_size: Optional[int]) -> int:
    """Deal the input lines to the partition files; returns how many are documents (not blank).
    Lines are checked for UTF-8 here, where the input file and line number are still known."""
    index = line_count = documents = 0
    for path in inputs:
        with _open_text(path) as fin:
            for line_number, line in enumerate(fin, start=1):
                not_utf8 = _not_utf8(line)
                if not_utf8 is not None:
                    raise _input_error(path, line_number, not_utf8)
                documents += bool(line.strip())
                outs[index].write(line)
                if partition_size is not None:
                    line_count += 1
                    index = min(line_count // partition_size, args.partitions - 1)
                else:
                    index = (index + 1) % args.partitions
    return documents


def _partition_totals(args, names: List[Tuple[str, str]], level: str) -> Tuple[int, Dict[str, int]]:
    """(documents, tokens per key) over the partitions' outputs, read from their .idx files."""
    documents, tokens = 0, {}
    for key in args.json_keys:  # every line adds one document under each key: any key counts them
        indexes = [indexed_dataset.IndexedDataset(f"{out}_{key}_{level}").index for _, out in names]
        documents = sum(len(index.document_indices) - 1 for index in indexes)
        tokens[key] = sum(int(index.sequence_lengths.sum()) for index in indexes)
    return documents, tokens


def _remove_partition_outputs(args, names: List[Tuple[str, str]], level: str) -> None:
    for _, out in names:
        for key in args.json_keys:
            for path in (indexed_dataset.get_bin_path(f"{out}_{key}_{level}"),
                         indexed_dataset.get_idx_path(f"{out}_{key}_{level}")):
                os.unlink(path)


def _merge_partitions(args, names: List[Tuple[str, str]], level: str, dtype, inputs: str) -> None:
    """Merge the partitions' outputs, in partition order, into `<output-prefix>_<key>_<level>`.
    Partitions may be empty one by one, not all together (_check_not_empty on the total)."""
    documents, tokens = _partition_totals(args, names, level)
    try:
        _check_not_empty(inputs, documents, tokens)
    except SystemExit:
        _remove_partition_outputs(args, names, level)  # empty .bin/.idx pairs, not to be taken for a result
        raise
    for key in args.json_keys:
        prefix = f"{args.output_prefix}_{key}_{level}"
        builder = indexed_dataset.IndexedDatasetBuilder(indexed_dataset.get_bin_path(_temporary(prefix)), dtype=dtype)
        for _, out in names:
            builder.add_index(f"{out}_{key}_{level}")
        builder.finalize(indexed_dataset.get_idx_path(_temporary(prefix)))
        _publish(_temporary(prefix), prefix)
        print(f"Merged {len(names)} partitions into {prefix}.bin/.idx", file=sys.stderr, flush=True)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Tokenize JSON lines into Megatron .bin/.idx files.",
                                     allow_abbrev=False)
    _add_tokenizer_args(parser)
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True, help="Path to input JSON lines (a glob with --partitions)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="Keys to extract from each JSON line")
    group.add_argument("--split-sentences", action="store_true", help="Split documents into sentences (nltk).")
    group.add_argument("--keep-newlines", action="store_true", help="Keep newlines between sentences when splitting.")
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument("--append-eod", action="store_true", help="Append an <eod> token to the end of a document.")
    group.add_argument("--lang", type=str, default="english", help="Language for NLTK sentence splitting.")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="Path to binary output file without suffix")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, required=True, help="Number of worker processes (over all partitions).")
    group.add_argument("--partitions", type=int, default=1, help="Number of file partitions")
    group.add_argument("--log-interval", type=int, default=1000, help="Interval between progress updates")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="Keep the input order of samples when using --partitions > 1.")
    args = parser.parse_args(argv)
    if args.tokenizer_type is None:
        parser.error("--tokenizer-type is required")
    if args.workers < 1 or args.partitions < 1 or args.log_interval < 1:
        parser.error(f"--workers ({args.workers}), --partitions ({args.partitions}) and --log-interval "
                     f"({args.log_interval}) must be >= 1")
    if args.workers % args.partitions != 0:
        parser.error(f"--workers {args.workers} must be a multiple of --partitions {args.partitions}")
    if args.keep_newlines and not args.split_sentences:
        parser.error("--keep-newlines applies to --split-sentences only")
    args.keep_empty = False
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = get_args(argv)
    try:
        tokenizer = build_tokenizer(args)  # a bad tokenizer flag fails here, before any worker starts
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise SystemExit(f"preprocess_data.py: error: {err}") from None
    if args.append_eod and tokenizer.eod is None:
        raise SystemExit("preprocess_data.py: error: --append-eod needs a tokenizer with an end-of-document "
                         "token (HuggingFaceTokenizer: eos_token in tokenizer_config.json)")
    if args.split_sentences:
        _sentence_splitter(args.lang, args.keep_newlines)
    level = "sentence" if args.split_sentences else "document"
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(out_dir):
        raise SystemExit(f"preprocess_data.py: error: the --output-prefix directory {out_dir} does not exist")

    if args.partitions == 1:
        if not os.path.isfile(args.input):
            raise SystemExit(f"preprocess_data.py: error: --input {args.input} does not exist")
        _encode_partition(args, args.input, args.output_prefix, args.workers, level)
        return

    inputs = sorted(glob.glob(args.input))
    if not inputs:
        raise SystemExit(f"preprocess_data.py: error: --input {args.input} matches no file")
    names = _write_partitions(args, inputs)
    workers = args.workers // args.partitions
    ctx = multiprocessing.get_context("fork")
    processes = [ctx.Process(target=_encode_partition, args=(args, p, out, workers, level, True))
                 for p, out in names]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    failed = [names[i][0] for i, p in enumerate(processes) if p.exitcode != 0]
    if failed:
        raise SystemExit(f"preprocess_data.py: error: tokenizing {', '.join(failed)} failed (see above)")
    dtype = indexed_dataset.DType.optimal_dtype(tokenizer.vocab_size)
    _merge_partitions(args, names, level, dtype, ", ".join(inputs))


if __name__ == "__main__":
    main()
