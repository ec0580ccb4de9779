"""Data pipeline speed: tools/preprocess_data.py (documents/s, MB/s at 1 and 2 workers), the GPT
index build for 10M tokens, and the blending indices; optionally against Megatron-Core's own code.

    python benchmarks/bench_data.py [--docs 4000] [--tokens 10000000] [--megatron-path DIR]

The corpus is this Python's standard library source (real text, on every machine). The tokenizer is
GPT2BPETokenizer with a byte-level BPE vocabulary trained on that corpus by the optional `tokenizers`
package (8k tokens), or, without it, the 256 byte tokens alone (no merges: a cheaper tokenization).
`--megatron-path` names a directory from which `megatron.core.datasets` imports (Megatron-Core's
sources with helpers_cpp compiled for this Python) to time Megatron's builder on the same files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def stdlib_corpus(path: str, max_docs: int) -> int:
    """One JSON line per standard-library .py file; returns the number of bytes written."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(stdlib) for f in fs if f.endswith(".py"))
    written = 0
    with open(path, "w", encoding="utf-8") as out:
        for name in files[:max_docs]:
            with open(name, encoding="utf-8", errors="replace") as f:
                line = json.dumps({"text": f.read()}) + "\n"
            out.write(line)
            written += len(line.encode("utf-8"))
    return written


def gpt2_files(directory: str, corpus: str) -> str:
    """vocab.json/merges.txt: trained with `tokenizers` when it is installed, else bytes only."""
    from megatron_fsdp.training.tokenizer.gpt2_tokenization import bytes_to_unicode

    vocab_path, merges_path = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    try:
        from tokenizers import ByteLevelBPETokenizer

        trainer = ByteLevelBPETokenizer()
        with open(corpus, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for _, line in zip(range(500), f)]
        trainer.train_from_iterator(texts, vocab_size=8192, special_tokens=["<|endoftext|>"], show_progress=False)
        trainer.save_model(directory)
        kind = "byte-level BPE, 8192 tokens (trained with `tokenizers`)"
    except ImportError:
        vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
        vocab["<|endoftext|>"] = len(vocab)
        with open(vocab_path, "w") as f:
            json.dump(vocab, f)
        open(merges_path, "w").close()
        kind = "bytes only, 257 tokens (`tokenizers` not installed)"
    return kind


def bench_preprocess(tmp: str, docs: int) -> None:
    corpus = os.path.join(tmp, "stdlib.jsonl")
    nbytes = stdlib_corpus(corpus, docs)
    kind = gpt2_files(tmp, corpus)
    with open(corpus) as f:
        ndocs = sum(1 for _ in f)
    print(f"preprocess_data: {ndocs} documents, {nbytes / 1e6:.1f} MB (Python {sys.version.split()[0]} stdlib); "
          f"GPT2BPETokenizer, {kind}")
    outputs = []
    for workers in (1, 2):
        prefix = os.path.join(tmp, f"out{workers}")
        cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
               "--output-prefix", prefix, "--tokenizer-type", "GPT2BPETokenizer",
               "--vocab-file", os.path.join(tmp, "vocab.json"), "--merge-file", os.path.join(tmp, "merges.txt"),
               "--append-eod", "--workers", str(workers), "--log-interval", "1000000"]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        elapsed = time.perf_counter() - start
        outputs.append(open(prefix + "_text_document.bin", "rb").read())
        tokens = len(outputs[-1]) // 2
        print(f"  --workers {workers}: {elapsed:6.2f} s wall (process start included)  {ndocs / elapsed:8.1f} docs/s  "
              f"{nbytes / elapsed / 2**20:6.2f} MB/s  {tokens / elapsed / 1e3:8.1f} k tokens/s")
    print(f"  1 and 2 workers wrote identical files: {outputs[0] == outputs[1]}")


def write_tokens(prefix: str, total_tokens: int, seed: int = 0) -> int:
    from megatron_fsdp.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 2000, size=total_tokens // 1000 + 10)
    lengths = lengths[np.cumsum(lengths) <= total_tokens]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for length in lengths:
        builder.add_document(rng.integers(0, 50000, size=int(length)), [int(length)])
    builder.finalize(prefix + ".idx")
    return int(lengths.sum())


def bench_index_build(tmp: str, total_tokens: int, megatron_path: str | None) -> None:
    prefix = os.path.join(tmp, "tokens")
    written = write_tokens(prefix, total_tokens)
    print(f"GPT index build: {written / 1e6:.1f}M tokens, sequence length 2048, split 969,30,1, "
          "train samples = 3 epochs' worth")
    samples = 3 * written // 2048
    for name, path in (("megatron_fsdp", None), ("Megatron-Core", megatron_path)):
        if name == "Megatron-Core" and path is None:
            continue
        elapsed = _time_build(prefix, samples, tmp, path)
        print(f"  {name:14s} {elapsed:6.3f} s (document, sample and shuffle indices, all splits, no cache)")


def _time_build(prefix: str, samples: int, tmp: str, megatron_path: str | None) -> float:
    code = f"""
import sys, time, tempfile, warnings, logging
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
sys.path.insert(0, {megatron_path or ROOT!r}); sys.path.insert(1, {ROOT!r})
from megatron_fsdp.training.tokenizer.null_tokenizer import NullTokenizer
pkg = "megatron.core.datasets" if {megatron_path is not None} else "megatron_fsdp.datasets"
gpt = __import__(pkg + ".gpt_dataset", fromlist=["x"])
builder = __import__(pkg + ".blended_megatron_dataset_builder", fromlist=["x"])
cfg = gpt.GPTDatasetConfig(random_seed=1234, sequence_length=2048, blend=([{prefix!r}], None), split="969,30,1",
    tokenizer=NullTokenizer(50304), reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    path_to_cache=tempfile.mkdtemp(dir={tmp!r}))
start = time.perf_counter()
builder.BlendedMegatronDatasetBuilder(gpt.GPTDataset, [{samples}, 100, 10], lambda: True, cfg).build()
print(time.perf_counter() - start)
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def bench_blending(size: int, megatron_path: str | None) -> None:
    from megatron_fsdp.datasets.helpers import build_blending_indices
    from megatron_fsdp.datasets.utils import normalize

    print(f"Blending indices, {size} samples:")
    helpers_cpp = None
    if megatron_path:
        sys.path.insert(0, megatron_path)
        helpers_cpp = importlib.import_module("megatron.core.datasets.helpers_cpp")
    for weights in ([0.3, 0.7], [0.25, 0.25, 0.25, 0.25], list(np.random.default_rng(0).random(5))):
        w = normalize(weights)
        index, sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
        start = time.perf_counter()
        build_blending_indices(index, sample, w, len(w), size)
        ours = time.perf_counter() - start
        line = f"  {len(w)} datasets {str([round(x, 2) for x in w]):36s} megatron_fsdp {ours:6.2f} s"
        if helpers_cpp is not None:
            theirs_index, theirs_sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
            start = time.perf_counter()
            helpers_cpp.build_blending_indices(theirs_index, theirs_sample, np.array(w), len(w), size, False)
            line += f"   Megatron C++ {time.perf_counter() - start:6.3f} s   identical: " \
                    f"{np.array_equal(index, theirs_index) and np.array_equal(sample, theirs_sample)}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=2000, help="standard-library files to preprocess")
    parser.add_argument("--tokens", type=int, default=10_000_000, help="tokens for the index build")
    parser.add_argument("--blend-samples", type=int, default=1_000_000)
    parser.add_argument("--megatron-path", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench_preprocess(tmp, args.docs)
        bench_index_build(tmp, args.tokens, args.megatron_path)
    bench_blending(args.blend_samples, args.megatron_path)


if __name__ == "__main__":
    main()
