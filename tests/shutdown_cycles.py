"""Run many short 4-process jobs and report how each process exited.

    python tests/shutdown_cycles.py --cycles 30 --world-size 4 [--no-barrier]

Each cycle forks `world_size` children from this already-initialized
interpreter (starting torch is the slow part on 2 cores), and each child runs
a whole job: init_process_group, three steps of a small `fully_shard` model,
shutdown, and then a normal interpreter exit, where the abort this guards
against happens. `--no-barrier` ends the way scripts did before
shutdown_distributed (destroy the process group straight away), to show that
the check can fail. `--fail-rank R` makes rank R raise after training while
the others wait for it in a collective (from cycle `--fail-from-cycle` on):
every process must still end promptly, and R's log must hold its own error.
Prints one JSON line: the exit status (and, for a failure, the log tail) of
every process, and the seconds its cycle took.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from megatron_fsdp import parallel_state  # noqa: E402
from megatron_fsdp.training.initialize import distributed_job  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_job(rank: int, world_size: int, port: int, cycle: int, barrier: bool, fail_rank: int) -> None:
    torch.set_num_threads(1)
    # Clients of a store that outlives the job, as under torchrun (its agent hosts the store).
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"cycle{cycle}/", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))

    def train_a_step():
        # Bare FSDP2, as in the original report: three steps of a sharded MLP.
        mesh = init_device_mesh("cpu", (world_size,))
        model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            model(torch.randn(4, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        if rank == fail_rank:
            raise ValueError(f"injected failure on rank {rank}")
        # The others wait for it in a collective it never joins.
        dist.all_reduce(torch.ones(1))

    if barrier:
        with distributed_job(timeout=timedelta(seconds=60)):
            train_a_step()
    else:
        train_a_step()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cycles", type=int, default=30)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--no-barrier", action="store_true")
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank raises after training")
    p.add_argument("--fail-from-cycle", type=int, default=0, help="the first cycle where --fail-rank raises")
    args = p.parse_args()
    log_dir = tempfile.mkdtemp(prefix="shutdown_cycles_")
    port = _free_port()
    store_host = os.fork()
    if store_host == 0:
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
        while True:
            time.sleep(60)
    # What torch allocated at import is never collected in the children:
    # skipping it halves the interpreter's exit time.
    gc.freeze()
    statuses = []
    for cycle in range(args.cycles):
        fail_rank = args.fail_rank if cycle >= args.fail_from_cycle else -1
        start = time.monotonic()
        children = {}
        for rank in range(args.world_size):
            log = os.path.join(log_dir, f"cycle{cycle}_rank{rank}.log")
            pid = os.fork()
            if pid == 0:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = 0
                try:
                    one_job(rank, args.world_size, port, cycle, barrier=not args.no_barrier, fail_rank=fail_rank)
                except BaseException:
                    import traceback
                    traceback.print_exc()
                    code = 3
                # A normal interpreter exit (not os._exit): the abort happens in its teardown.
                sys.exit(code)
            children[pid] = (rank, log)
        for _ in children:
            pid, status = os.waitpid(-1, 0)
            rank, log = children[pid]
            code = os.waitstatus_to_exitcode(status)
            with open(log, errors="replace") as f:
                tail = f.read()[-2000:]
            statuses.append({"cycle": cycle, "rank": rank, "exit": code,
                             "log": tail if code != 0 or "terminate called" in tail else ""})
        for status in statuses[-args.world_size:]:
            status["cycle_seconds"] = time.monotonic() - start
    os.kill(store_host, signal.SIGKILL)
    os.waitpid(store_host, 0)
    print(json.dumps({"statuses": statuses, "log_dir": log_dir}))


if __name__ == "__main__":
    main()
