"""The Flight Recorder trace of a collective timeout: each rank's last collectives.

torch records every collective of a process in a ring buffer (its Flight Recorder: the last
--flight-recorder-buffer-size, TORCH_FR_BUFFER_SIZE, of them; on by default). When a collective
times out, that record says what each rank had started and finished, which the phase names of
progress.py cannot: which collective of which group, how far each rank got.

- NCCL: torch's watchdog writes every rank's record on a timeout (TORCH_NCCL_DUMP_ON_TIMEOUT), to
  TORCH_FR_DUMP_TEMP_FILE<rank>; `configure` points it at --flight-recorder-dir before the process
  group exists and says where, since the watchdog may end the process before Python hears of it.
- gloo (torch >= 2.8 records it too) and any other backend: nothing in torch writes it; the rank
  whose collective timed out writes its own, and its one-line error says where (`dump_on_timeout`).

Either way the files are `<dir>/rank_<rank>`, the pickles torch's analyzer reads:
`python -m torch.distributed.flight_recorder.fr_trace <dir>`. torchtitan's comm.trace_buf_size
and comm.save_traces_folder are the same two settings.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from .. import _torch_compat
from .utils import write_whole

DEFAULT_DIR = "comm_traces"
PREFIX_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # torch's name, and its older one


def trace_prefix(args) -> str:
    """Where the traces go, as torch names them: the prefix each rank's number is appended to."""
    if getattr(args, "flight_recorder_dir", None) is not None:
        return os.path.join(args.flight_recorder_dir, "rank_")
    for name in PREFIX_ENV:
        if os.environ.get(name):
            return os.environ[name]
    return os.path.join(DEFAULT_DIR, "rank_")


def configure(args, backend: str) -> None:
    """Before init_process_group: torch reads these when it creates its recorders. (Flags a script
    of its own may not have: torch's defaults then.)"""
    size = getattr(args, "flight_recorder_buffer_size", None)
    if size is not None:
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(size)
    if backend != "nccl" or size == 0:
        return
    prefix = trace_prefix(args)
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)  # torch's writer makes only its default's
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"> Flight Recorder: on a collective timeout torch's NCCL watchdog writes each rank's last "
              f"collectives to {prefix}<rank>", flush=True)


def dump_on_timeout(args) -> str:
    """After this rank's collective timed out: its Flight Recorder trace written (or found, where
    torch's watchdog wrote it), as the end of the timeout's one line. Never raises: the timeout
    is the error to report."""
    if getattr(args, "flight_recorder_buffer_size", None) == 0:
        return "; no Flight Recorder trace (--flight-recorder-buffer-size 0)"
    try:
        backend, path = dist.get_backend(), f"{trace_prefix(args)}{dist.get_rank()}"
        if backend == "nccl" and os.path.exists(path):
            return f"; Flight Recorder trace (torch's NCCL watchdog): {path}"
        trace = _torch_compat.flight_recorder_trace(backend)
        if trace is None:
            return f"; no Flight Recorder trace: this torch records none for {backend}"
        def write(temporary: str) -> None:
            with open(temporary, "wb") as f:
                f.write(trace)

        write_whole(path, write)
        return f"; this rank's Flight Recorder trace (its last collectives): {path}"
    except Exception as exc:
        return f"; no Flight Recorder trace ({type(exc).__name__}: {exc})"
