"""Cost of checkpoint checksums: save and load time with and without them.

One process on CPU, a model of a few hundred MB saved with
megatron_fsdp.training.checkpointing (sharded DCP checkpoint, fsynced,
published by rename). Saves and loads without checksums and with each
algorithm (CRC-32C, what saves record when the extension is built, and
zlib's CRC-32, what they record without it) take turns in the same run, the
order rotating; the median and the best of the repetitions are reported (on
a busy machine the best is the steadier figure), and the median CPU time of
the process (all its threads: what the checksums cost in work, whatever else
runs on the machine).

    .venv/bin/python benchmarks/bench_checkpoint.py --size-mb 300 --repeats 15
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

from megatron_fsdp.dist_checkpointing import checksums
from megatron_fsdp.training.checkpointing import load_checkpoint, save_checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=300, help="fp32 model size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--algorithms", default=checksums.save_algorithm(),
                        help=f"comma-separated, from {', '.join(checksums.ALGORITHMS)} (default: what saves use here)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    algorithms = args.algorithms.split(",")
    for algorithm in algorithms:
        if algorithm not in checksums.ALGORITHMS:
            raise SystemExit(f"--algorithms: unknown {algorithm!r}; choose from {', '.join(checksums.ALGORITHMS)}")
    if "crc32c" in algorithms and checksums.save_algorithm() != "crc32c":
        raise SystemExit("--algorithms crc32c needs the extension (without it CRC-32C runs in pure PyTorch)")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)

    width = 2048
    layers = max(1, args.size_mb * 2**20 // (width * width * 4))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_ckpt_")
    arms = ["none"] + algorithms
    times = {what: {arm: [] for arm in arms} for what in ("save", "load", "save_cpu", "load_cpu")}
    default_algorithm = checksums.save_algorithm
    try:
        for rep in range(args.repeats + 1):  # the first round warms the page cache and allocator
            for arm in arms[rep % len(arms):] + arms[:rep % len(arms)]:
                ckpt = os.path.join(root, arm)
                checksums.save_algorithm = default_algorithm if arm == "none" else (lambda arm=arm: arm)
                try:
                    start, cpu = time.perf_counter(), time.process_time()
                    save_checkpoint(rep, model, None, None, ckpt, record_checksums=arm != "none")
                    saved, saved_cpu = time.perf_counter() - start, time.process_time() - cpu
                    start, cpu = time.perf_counter(), time.process_time()
                    load_checkpoint(model, None, None, ckpt, verify=arm != "none", load_rng=False)
                    loaded, loaded_cpu = time.perf_counter() - start, time.process_time() - cpu
                finally:
                    checksums.save_algorithm = default_algorithm
                if rep > 0:
                    for what, value in (("save", saved), ("load", loaded), ("save_cpu", saved_cpu),
                                        ("load_cpu", loaded_cpu)):
                        times[what][arm].append(value)
                shutil.rmtree(ckpt)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"model {size / 2**20:.0f} MiB ({layers} x Linear({width}, {width}), fp32), {args.repeats} repetitions")
    for what, stat in (("save", statistics.median), ("save", min), ("save_cpu", statistics.median),
                       ("load", statistics.median), ("load", min), ("load_cpu", statistics.median)):
        off = stat(times[what]["none"])
        label = "CPU time, median" if what.endswith("cpu") else "median" if stat is statistics.median else "best"
        line = f"{what[:4]} ({label}): {off:.3f} s without checksums"
        for algorithm in algorithms:
            on = stat(times[what][algorithm])
            line += f"; {algorithm} {on:.3f} s, {100 * (on / off - 1):+.1f}%"
        print(line)


if __name__ == "__main__":
    main()
