"""A real text corpus on any machine, offline: the Python standard library's own sources.

    python tools/stdlib_corpus.py --output-dir data/stdlib [--max-megabytes 8]

Writes into --output-dir:
  stdlib.jsonl       one JSON line per .py file of this interpreter's standard
                     library ({"text": <source>, "path": <relative path>}),
                     in sorted path order, the input of tools/preprocess_data.py
  byte-vocab.json    a byte-level GPT-2 vocabulary (the 256 byte symbols of
  byte-merges.txt    GPT-2's byte-to-unicode map plus <|endoftext|>) with no
                     merges, for --tokenizer-type GPT2BPETokenizer: one token
                     per byte, so no tokenizer has to be trained or downloaded.
                     Real runs use GPT-2's own vocab.json/merges.txt instead.

Every file is written to a temporary name and renamed, so an interrupted run
leaves nothing half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

from megatron_fsdp.training.tokenizer.gpt2_tokenization import bytes_to_unicode


def stdlib_sources(max_bytes: int):
    """(relative path, text) of the standard library's .py files, sorted, up to max_bytes of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] in ("site-packages", "dist-packages"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
        if not text.strip():
            continue
        total += len(text.encode("utf-8"))
        if total > max_bytes:
            return
        yield str(relative), text


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-megabytes", type=float, default=8.0, help="stop after this much source text (default 8)")
    args = p.parse_args(argv)
    if args.max_megabytes <= 0:
        p.error(f"--max-megabytes must be positive, got {args.max_megabytes}")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    counts = {"files": 0, "bytes": 0}

    def write_corpus(f):
        for relative, text in stdlib_sources(int(args.max_megabytes * 2 ** 20)):
            f.write(json.dumps({"text": text, "path": relative}) + "\n")
            counts["files"] += 1
            counts["bytes"] += len(text.encode("utf-8"))

    _write_atomically(out / "stdlib.jsonl", write_corpus)
    if counts["files"] == 0:
        print(f"no standard-library sources found under {sysconfig.get_paths()['stdlib']}", file=sys.stderr)
        return 1
    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode()[b] for b in range(256))}
    vocab["<|endoftext|>"] = len(vocab)
    _write_atomically(out / "byte-vocab.json", lambda f: json.dump(vocab, f, ensure_ascii=False))
    _write_atomically(out / "byte-merges.txt", lambda f: f.write("#version: 0.2\n"))
    print(f"wrote {counts['files']} files, {counts['bytes'] / 2 ** 20:.1f} MiB of text to {out / 'stdlib.jsonl'}; "
          f"byte-level vocabulary of {len(vocab)} tokens to {out / 'byte-vocab.json'} and {out / 'byte-merges.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
