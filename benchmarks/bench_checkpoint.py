"""Checkpoint saves: the training loop's stall of a synchronous and an asynchronous save, in one run.

    python benchmarks/bench_checkpoint.py [--repeats 5] [--slow-write-ms 0] [--save-dir DIR]
    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py ...
    python benchmarks/bench_checkpoint.py --compare checksums --size-mb 300 --repeats 15

--compare async-save (the default): one GPT (GPTModel in TorchFullyShardedDataParallel,
get_megatron_optimizer's AdamW; --hidden-size, --num-layers, --vocab-size), on the GPU when
there is one, else the CPU, saved through megatron_fsdp.training.checkpointing.save_checkpoint
by two CheckpointManagers (dist_checkpointing.manager): a synchronous one and an asynchronous
one (Megatron's --async-save). After --warmup-steps training steps and one untimed round, each
of --repeats rounds runs three arms, the order rotating from round to round:

  plain   one training step without a save: the step time the others are judged against
  sync    save_checkpoint (its time from call to return is the loop's stall: the whole save),
          then the next step
  async   save_checkpoint (call to return: planning and staging the state into CPU memory,
          pinned with CUDA), then the next step, which runs while the background thread writes
          (its slowdown against `plain`), then finalize(blocking=True): what is left of the write
          (manager's write_s: the whole background write, from the end of staging to the publish)

Reported: medians over the rounds of the slowest rank's figures; the ratio async stall / sync
stall; the staged bytes per rank (manager.last_staged_bytes, against the bytes of the state's
tensors) and the first async save's stall (it allocates the staging buffers, later saves reuse
them). --slow-write-ms N sleeps N ms per file a save writes (a patched
ChecksumFileSystem.create_stream), standing in for a slow file system: both arms pay it, the
async one off the loop.

Then, untimed, one more async save whose file writes wait until the training step after it has
finished (the step changes the weights and the AdamW state before a byte is written): that
checkpoint is loaded into a freshly built model and optimizer (another seed) and checked equal,
tensor by tensor, to their state when the save was called. A staged state that is not a copy
(a step reaching the checkpoint: a torn save) fails the run. Rank 0 prints a table and one JSON
line ("case"; "ours_ms" the async stall, "sync_ms" the sync stall, as scripts/gpu_check.sh reads
them).

Run by `python` alone it is a world of one (gloo; torch.distributed is set up in-process); under
torchrun each process is a rank (gloo on the CPU; on a GPU "cpu:gloo,cuda:nccl": the
asynchronous save's collectives run on CPU groups). --save-dir must be one directory every rank
sees (default: a temporary directory); the benchmark writes into a new directory inside it and
removes that at the end.

--compare checksums: the cost of checkpoint checksums, save and load time with and without
them. One process on CPU, a model of --size-mb saved with save_checkpoint (sharded DCP
checkpoint, fsynced, published by rename). Saves and loads without checksums and with each
algorithm (CRC-32C, what saves record when the extension is built, and zlib's CRC-32, what they
record without it) take turns in the same run, the order rotating; the median and the best of
the repetitions are reported (on a busy machine the best is the steadier figure), and the median
CPU time of the process (all its threads: what the checksums cost in work, whatever else runs on
the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from _common import api_step, device_name, single_process_defaults
from megatron_fsdp import parallel_state, tensor_parallel
from megatron_fsdp.dist_checkpointing import checksums
from megatron_fsdp.dist_checkpointing.manager import (CheckpointManager, set_checkpoint_manager, tensor_bytes,
                                                      to_plain)
from megatron_fsdp.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel
from megatron_fsdp.models.gpt import GPTModel
from megatron_fsdp.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_fsdp.training.checkpointing import checkpoint_dir, checkpoint_states, load_checkpoint, save_checkpoint
from megatron_fsdp.training.initialize import distributed_job
from megatron_fsdp.transformer import TransformerConfig

PROG = "bench_checkpoint.py"
ARMS = ("plain", "sync", "async")


def _error(message: str) -> SystemExit:
    """One line, as scripts/gpu_check.sh finds it in a log."""
    rank = f" on rank {dist.get_rank()}" if dist.is_initialized() and dist.get_world_size() > 1 else ""
    return SystemExit(f"{PROG}: error{rank}: {message}")


# ---------------------------------------------------------------- --compare async-save


@contextlib.contextmanager
def slow_writes(ms: float):
    """Every file a checkpoint save writes (through ChecksumFileSystem) takes `ms` longer."""
    if ms <= 0:
        yield
        return
    original = checksums.ChecksumFileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode:
            time.sleep(ms / 1000)
        with original(self, path, mode) as stream:
            yield stream

    checksums.ChecksumFileSystem.create_stream = create_stream
    try:
        yield
    finally:
        checksums.ChecksumFileSystem.create_stream = original


@contextlib.contextmanager
def writes_held():
    """Inside, every file a save opens for writing waits until `release()` (yielded) is called:
    the verification's async save then writes only after the step that follows it changed the
    state, so a checkpoint that is not a copy of the state at the save cannot pass by luck."""
    original = checksums.ChecksumFileSystem.create_stream
    released = threading.Event()

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" in mode and not released.wait(timeout=600):
            raise RuntimeError("the benchmark never released the held checkpoint writes")
        with original(self, path, mode) as stream:
            yield stream

    checksums.ChecksumFileSystem.create_stream = create_stream
    try:
        yield released.set
    finally:
        released.set()
        checksums.ChecksumFileSystem.create_stream = original


def _init_process_group() -> None:
    single_process_defaults()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # The asynchronous save needs a CPU backend in the default group next to NCCL.
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        dist.init_process_group("gloo")


def _build(args, config: TransformerConfig, seed: int):
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config, vocab_size=args.vocab_size, max_sequence_length=args.seq)
    model = TorchFullyShardedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, adam_eps=1e-5, clip_grad=1.0), model)
    return model, optimizer


def _state_tensors(model, optimizer) -> dict:
    """This rank's part of every tensor a checkpoint holds of the model and the optimizer, by
    name (the entries save_checkpoint writes), copied to the CPU."""
    found = {}

    def walk(obj, name):
        if isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{name}.{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{name}.{i}")
        elif isinstance(obj, torch.Tensor):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            found[name] = local.detach().to("cpu", copy=True)

    states = checkpoint_states(0, model, optimizer)
    for entry in ("model", "optimizer", "main_params"):
        if entry in states:
            walk(to_plain({entry: states[entry]})[entry], entry)
    return found


def _differences(expected: dict, found: dict) -> list[str]:
    wrong = sorted(set(expected) ^ set(found))
    wrong += [k for k in sorted(set(expected) & set(found)) if not torch.equal(expected[k], found[k])]
    return wrong


def _all_ranks_max(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the CPU backend of the default group
    return t.tolist()


def async_save_main(args) -> None:
    _init_process_group()
    with distributed_job():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        device = parallel_state.get_device()
        cuda = device.type == "cuda"
        rank, world = dist.get_rank(), dist.get_world_size()
        config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                   num_attention_heads=args.heads, hidden_dropout=0.0, attention_dropout=0.0)
        model, optimizer = _build(args, config, args.seed)
        parameters = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, args.vocab_size, (args.micro_batch, args.seq), generator=g).to(device)
        positions = torch.arange(args.seq, device=device).expand(args.micro_batch, -1)

        box = [tempfile.mkdtemp(dir=args.save_dir, prefix="bench_ckpt_") if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        root = box[0]
        dirs = {arm: os.path.join(root, arm) for arm in ("sync", "async")}
        managers = {"sync": CheckpointManager(async_save=False), "async": CheckpointManager(async_save=True)}
        for manager in managers.values():
            manager.setup()
        previous_manager = set_checkpoint_manager(None)
        iteration = 0

        def sync_all():
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()

        def step() -> float:
            nonlocal iteration
            sync_all()
            start = time.perf_counter()
            api_step(model, optimizer, ids, positions)
            if cuda:
                torch.cuda.synchronize()
            iteration += 1
            return time.perf_counter() - start

        saved, latest = {}, {}  # each arm's checkpoint of its last save; its latest published one

        def save(arm: str) -> float:
            """The loop's stall: save_checkpoint from call to return."""
            set_checkpoint_manager(managers[arm])
            sync_all()
            start = time.perf_counter()
            save_checkpoint(iteration, model, optimizer, None, dirs[arm])
            stall = time.perf_counter() - start
            saved[arm] = checkpoint_dir(dirs[arm], iteration)
            return stall

        def keep_only_latest(arm: str) -> None:
            # The checkpoint before this arm's last one is of no more use: rank 0 removes it.
            path = saved[arm]
            dist.barrier()
            if rank == 0 and latest.get(arm) not in (None, path):
                shutil.rmtree(latest[arm], ignore_errors=True)
            latest[arm] = path

        def run_arm(arm: str, timed: dict) -> None:
            if arm == "plain":
                timed["step"] = step()
                return
            if arm == "sync":
                timed["sync_stall"] = save("sync")
                timed["sync_blocking"] = managers["sync"].last_saved.blocking_s
                timed["step_after_sync"] = step()
                keep_only_latest("sync")
                return
            manager = managers["async"]
            timed["async_stall"] = save("async")
            pending = manager.pending
            if pending is None:
                raise _error("the asynchronous save returned with no save pending (manager.pending is None)")
            timed["async_blocking"] = pending.blocking_s
            timed["staged_bytes"] = manager.last_staged_bytes
            timed["step_during_write"] = step()
            start = time.perf_counter()
            published = manager.finalize(blocking=True)
            timed["finalize_wait"] = time.perf_counter() - start
            if published is None or published.write_s is None or published.path != saved["async"]:
                raise _error(f"finalize(blocking=True) returned {published!r}, not the published {saved['async']}")
            timed["write"] = published.write_s
            keep_only_latest("async")

        state_bytes = tensor_bytes(to_plain(checkpoint_states(0, model, optimizer)))
        finished = False
        try:
            with slow_writes(args.slow_write_ms):
                for _ in range(args.warmup_steps):
                    step()
                rounds = []
                for r in range(args.repeats + 1):  # round 0: untimed (groups, staging buffers, page cache)
                    timed = {}
                    for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                        run_arm(arm, timed)
                    rounds.append(timed)
                files = len(os.listdir(latest["async"])) if rank == 0 else 0

                # Untimed: one more async save whose writes wait until the step after it is done.
                snapshot = _state_tensors(model, optimizer)  # what the checkpoint must hold
                with writes_held() as release:
                    save("async")
                    step()
                    release()
                    managers["async"].finalize(blocking=True)
                keep_only_latest("async")
                changed_during_write = bool(_differences(snapshot, _state_tensors(model, optimizer)))

            # The last async checkpoint, loaded into a fresh model and optimizer (another seed).
            fresh_model, fresh_optimizer = _build(args, config, args.seed + 1)
            differed_before = any(k.startswith("model.") for k in
                                  _differences(snapshot, _state_tensors(fresh_model, fresh_optimizer)))
            load_checkpoint(fresh_model, fresh_optimizer, None, dirs["async"], load_rng=False)
            wrong = _differences(snapshot, _state_tensors(fresh_model, fresh_optimizer))
            finished = True
        finally:
            set_checkpoint_manager(previous_manager)
            for manager in managers.values():
                manager.wait_locally(timeout=60)  # a save still pending on an error's way out
                manager.close()
            if finished:
                dist.barrier()
            if rank == 0:
                shutil.rmtree(root, ignore_errors=True)

        wrong_anywhere = _all_ranks_max([float(len(wrong)), float(not differed_before),
                                         float(not changed_during_write)])
        if wrong_anywhere[0]:
            raise _error(f"the asynchronous checkpoint {latest['async']} does not hold the state at its save: "
                         f"{len(wrong)} tensor(s) on this rank differ or are missing, e.g. {wrong[:5]}")
        if wrong_anywhere[1] or wrong_anywhere[2]:  # then the check above proves nothing
            raise _error("the check of the asynchronous checkpoint proves nothing: "
                         + ("the fresh model equalled the saved state before the load" if wrong_anywhere[1] else
                            "the step during the write did not change the model"))

        # Each figure: the slowest rank's in each round, then the median over the rounds.
        keys = sorted(rounds[1])
        per_round = [_all_ranks_max([t[k] for k in keys]) for t in rounds[1:]]
        med = {k: statistics.median(row[i] for row in per_round) for i, k in enumerate(keys)}
        first = dict(zip(keys, _all_ranks_max([rounds[0][k] for k in keys])))
        bytes_max = _all_ranks_max([float(state_bytes), float(rounds[-1]["staged_bytes"])])
        ms = lambda s: round(1000 * s, 3)  # noqa: E731
        result = {
            "case": "checkpoint async vs sync save stall",
            "ours_ms": ms(med["async_stall"]), "sync_ms": ms(med["sync_stall"]),
            "async_over_sync": round(med["async_stall"] / med["sync_stall"], 4),
            "sync_over_async": round(med["sync_stall"] / med["async_stall"], 2),
            "step_ms": ms(med["step"]), "step_after_sync_ms": ms(med["step_after_sync"]),
            "step_during_write_ms": ms(med["step_during_write"]),
            "step_during_write_over_step": round(med["step_during_write"] / med["step"], 3),
            "write_ms": ms(med["write"]), "finalize_wait_ms": ms(med["finalize_wait"]),
            "sync_blocking_ms": ms(med["sync_blocking"]), "async_blocking_ms": ms(med["async_blocking"]),
            "first_async_stall_ms": ms(first["async_stall"]),
            "staged_bytes_per_rank": int(bytes_max[1]), "state_bytes_per_rank": int(bytes_max[0]),
            "verified": True, "changed_during_write": True, "files_per_checkpoint": files,
            "slow_write_ms": args.slow_write_ms, "repeats": args.repeats, "world_size": world,
            "parameters": parameters, "hidden_size": args.hidden_size, "num_layers": args.num_layers,
            "vocab_size": args.vocab_size, "device": device_name(), "torch": torch.__version__,
        }
        if rank == 0:
            mib = 2 ** 20
            print(f"GPT {parameters / 1e6:.2f}M parameters (hidden {args.hidden_size}, {args.num_layers} layers, "
                  f"vocab {args.vocab_size}), {world} rank(s), {result['device']}, torch {torch.__version__}; "
                  f"{args.repeats} rounds, medians of the slowest rank"
                  + (f"; {args.slow_write_ms:g} ms per file written" if args.slow_write_ms else ""))
            print(f"{'':<34} {'sync':>10} {'async':>10}")
            print(f"{'stall: save call to return (ms)':<34} {result['sync_ms']:>10.1f} {result['ours_ms']:>10.1f}")
            print(f"{'next step (ms)':<34} {result['step_after_sync_ms']:>10.1f} "
                  f"{result['step_during_write_ms']:>10.1f}   (a step without a save: {result['step_ms']:.1f})")
            print(f"{'background write (ms)':<34} {'':>10} {result['write_ms']:>10.1f}   (left after the next step: "
                  f"{result['finalize_wait_ms']:.1f})")
            print(f"async stall / sync stall: {result['async_over_sync']:.3f}; next step during the write / step "
                  f"without a save: {result['step_during_write_over_step']:.2f}; first async stall (allocates the "
                  f"staging buffers): {result['first_async_stall_ms']:.1f} ms")
            print(f"staged per rank: {result['staged_bytes_per_rank'] / mib:.2f} MiB (the state's tensors: "
                  f"{result['state_bytes_per_rank'] / mib:.2f} MiB); the async checkpoint loaded into a fresh model "
                  "equals the state at its save (the model changed during the write)")
            print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- --compare checksums


def checksums_main(args) -> None:
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
    root = tempfile.mkdtemp(dir=args.save_dir, prefix="bench_ckpt_")
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


def main():
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--compare", choices=["async-save", "checksums"], default="async-save",
                   help="async-save: the loop's stall of a sync and an async save; checksums: save and load "
                        "time with and without checksums")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (after one untimed round)")
    p.add_argument("--save-dir", "--dir", default=None,
                   help="where to write, seen by every rank (default: a temporary directory); the benchmark "
                        "writes into a new directory inside it and removes that")
    g = p.add_argument_group("--compare async-save")
    g.add_argument("--hidden-size", "--hidden", type=int, default=256)
    g.add_argument("--num-layers", "--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--vocab-size", "--vocab", type=int, default=1024)
    g.add_argument("--seq", type=int, default=128)
    g.add_argument("--micro-batch", type=int, default=4)
    g.add_argument("--warmup-steps", type=int, default=3, help="training steps before the first save")
    g.add_argument("--slow-write-ms", type=float, default=0.0,
                   help="sleep this long per file a save writes: a slow file system on a fast disk")
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("--compare checksums")
    g.add_argument("--size-mb", type=int, default=300, help="fp32 model size")
    g.add_argument("--algorithms", default=checksums.save_algorithm(),
                   help=f"comma-separated, from {', '.join(checksums.ALGORITHMS)} (default: what saves use here)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.compare == "checksums":
        checksums_main(args)
        return
    if args.slow_write_ms < 0:
        p.error(f"--slow-write-ms must be >= 0, got {args.slow_write_ms}")
    if args.hidden_size % args.heads:
        p.error(f"--hidden-size {args.hidden_size} is not a multiple of --heads {args.heads}")
    if args.save_dir is not None and not os.path.isdir(args.save_dir):
        p.error(f"--save-dir {args.save_dir} is not a directory")
    async_save_main(args)


if __name__ == "__main__":
    sys.exit(main())
