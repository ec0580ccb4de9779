"""Cost of checkpoint checksums: save and load time with and without them.

One process on CPU, a model of a few hundred MB saved with
megatron_fsdp.training.checkpointing (sharded DCP checkpoint, fsynced,
published by rename). With and without checksums alternate in the same
run; the median of the repetitions is reported.

    .venv/bin/python benchmarks/bench_checkpoint.py --size-mb 300 --repeats 5
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

from megatron_fsdp.training.checkpointing import load_checkpoint, save_checkpoint


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=300, help="fp32 model size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)

    width = 2048
    layers = max(1, args.size_mb * 2**20 // (width * width * 4))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_ckpt_")
    times = {"save": {True: [], False: []}, "load": {True: [], False: []}}
    try:
        for rep in range(args.repeats + 1):  # the first round warms the page cache and allocator
            for checksums in (True, False) if rep % 2 == 0 else (False, True):
                ckpt = os.path.join(root, f"{int(checksums)}")
                start = time.perf_counter()
                save_checkpoint(rep, model, None, None, ckpt, record_checksums=checksums)
                saved = time.perf_counter() - start
                start = time.perf_counter()
                load_checkpoint(model, None, None, ckpt, verify=checksums, load_rng=False)
                loaded = time.perf_counter() - start
                if rep > 0:
                    times["save"][checksums].append(saved)
                    times["load"][checksums].append(loaded)
                shutil.rmtree(ckpt)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(f"model {size / 2**20:.0f} MiB ({layers} x Linear({width}, {width}), fp32), "
          f"{args.repeats} repetitions, median")
    for what in ("save", "load"):
        on, off = statistics.median(times[what][True]), statistics.median(times[what][False])
        print(f"{what}: {off:.3f} s without checksums, {on:.3f} s with "
              f"({size / 2**30 / on:.2f} GiB/s): overhead {100 * (on / off - 1):+.1f}%")


if __name__ == "__main__":
    main()
