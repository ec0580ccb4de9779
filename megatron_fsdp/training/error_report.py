"""An error after start-up: one line, printed once for the whole job.

A failure after the flags were checked (a data file, a checkpoint, a NaN
stop, a timeout) is usually raised on several ranks, often on all of them
alike. Python would print a traceback per rank, and torchrun its failure
summary with `<N/A>` for ranks that leave no error file (naming rank 0 as
the root cause when several fail in the same second). Instead:

- the first rank to fail prints `<script>: error on rank R: Type: message`
  once (the ranks agree on who is first through the job's key-value store,
  the rendezvous store, which answers while ranks are failing), and every
  failing rank exits with code 1;
- every failing rank writes torchrun's error file (TORCHELASTIC_ERROR_FILE)
  in the format of torch.distributed.elastic's ErrorHandler: its summary
  then shows the one line as the first failure's "traceback", names the
  rank that failed first as the root cause (see _write_error_file), and
  shows "the same error as rank R" for the ranks that raised the same
  error. The full traceback is kept in that file ("megatron_fsdp_traceback"),
  which the summary names for each rank;
- with MEGATRON_FSDP_TRACEBACKS=1 the error propagates as usual: every
  rank prints its traceback (the one line and the error files are written
  all the same).

Flag errors never get here: they end the job before start-up with one line
on rank 0 and exit code 2 (training/arguments.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Optional


from .. import _torch_compat
from ..utils import get_rank_safe, is_distributed

TRACEBACKS_ENV = "MEGATRON_FSDP_TRACEBACKS"
_PREFIX = "megatron_fsdp/error/"
# How long a rank that did not fail first waits for the first one's line
# to be printed before it exits (its exit makes torchrun stop the others).
_PRINT_WAIT = timedelta(seconds=5)
_MAX_MESSAGE = 2000


def tracebacks_requested() -> bool:
    return os.environ.get(TRACEBACKS_ENV, "0") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message` (a longer message is cut, the rest is in the traceback)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else "(no message)"
    if len(lines) > 1 or len(text) > _MAX_MESSAGE:
        text = text[:_MAX_MESSAGE] + " [...]"
    return f"{type(exc).__name__}: {text}"


def _store():
    # Without the store each failing rank prints its own line.
    if not is_distributed():
        return None
    return _torch_compat.default_store()


class _Election:
    """Which failing rank reports: the first to claim it in the store."""

    def __init__(self, rank: int, line: str):
        self.rank = rank
        self.first, self.first_line = rank, line
        self.store = _store()
        if self.store is None:
            return
        try:
            self.store.set(f"{_PREFIX}{rank}", line)
            self.first = int(self.store.compare_set(f"{_PREFIX}first", "", str(rank)))
            if self.first != rank:
                self.first_line = self.store.get(f"{_PREFIX}{self.first}").decode()
        except Exception:  # the store is gone too: report on this rank
            self.store, self.first, self.first_line = None, rank, line

    @property
    def reports(self) -> bool:
        return self.first == self.rank

    def printed(self) -> None:
        if self.store is not None:
            try:
                self.store.set(f"{_PREFIX}printed", "1")
            except Exception:
                pass

    def wait_for_report(self) -> None:
        if self.store is not None:
            try:
                self.store.wait([f"{_PREFIX}printed"], _PRINT_WAIT)
            except Exception:
                pass


def _write_error_file(summary: str, full_traceback: str, first: bool) -> None:
    """torchrun's per-rank error file, in ErrorHandler's format (see the module docstring)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    # torchrun's root cause is the failure with the smallest whole-second time, ties going to
    # the lowest local rank, and a rank it kills without an error file gets the second it
    # noticed: the first failure is dated a second early, the others rounded up.
    data = {"message": {"message": summary, "extraInfo": {
        "py_callstack": summary,
        "timestamp": str(math.floor(now) - 1 if first else math.ceil(now)),
        "megatron_fsdp_traceback": full_traceback}}}
    try:  # whole or not at all: torchrun parses it once this process has exited
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def report(exc: BaseException, prog: Optional[str] = None) -> None:
    """Print `exc` as one line if this rank failed first, and write torchrun's error file."""
    prog = prog or os.path.basename(sys.argv[0]) or "megatron_fsdp"
    rank = get_rank_safe()
    line = one_line(exc)
    election = _Election(rank, line)
    full = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    if election.reports:
        where = "the error_file of each rank in torchrun's summary, or " if os.environ.get(
            "TORCHELASTIC_ERROR_FILE") else ""
        hint = "" if tracebacks_requested() else f" (tracebacks: {where}{TRACEBACKS_ENV}=1)"
        print(f"{prog}: error on rank {rank}: {line}{hint}", file=sys.stderr, flush=True)
        _write_error_file(line, full, first=True)
        election.printed()
        return
    same = line == election.first_line
    _write_error_file(f"the same error as rank {election.first}" if same else line, full, first=False)
    election.wait_for_report()


class report_errors:
    """`with report_errors(): ...` around everything after the flags are parsed:
    an Exception is reported (`report`) and becomes SystemExit(1), or, with
    MEGATRON_FSDP_TRACEBACKS=1, propagates. SystemExit and KeyboardInterrupt pass."""

    def __init__(self, prog: Optional[str] = None):
        self.prog = prog

    def __enter__(self) -> "report_errors":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None or not issubclass(exc_type, Exception):
            return False
        try:
            report(exc, self.prog)
        except Exception:  # reporting must never hide the error itself
            return False
        if tracebacks_requested():
            return False
        sys.stdout.flush()
        raise SystemExit(1) from exc
