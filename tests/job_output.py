"""Reading a failed torchrun job's output: the one-line error and torchrun's failure summary."""

from __future__ import annotations

import re

ERROR_LINE = re.compile(r"^(\S+\.py): error on rank (\d+): (.*) \(tracebacks: the error_file of each rank in "
                        r"torchrun's summary, or MEGATRON_FSDP_TRACEBACKS=1\)$")


def error_lines(stderr: str) -> list[re.Match]:
    """The one-line errors of megatron_fsdp.training.error_report in `stderr`."""
    return [m for m in map(ERROR_LINE.match, stderr.splitlines()) if m]


def root_cause(stderr: str) -> tuple[int, str]:
    """(rank, traceback field) of torchrun's "Root Cause (first observed failure)" entry."""
    section = stderr.split("Root Cause (first observed failure):", 1)[1]
    rank = re.search(r"^\s+rank\s+: (\d+)", section, flags=re.M)
    message = re.search(r"^\s+traceback : (.*)$", section, flags=re.M)
    assert rank and message, section
    return int(rank[1]), message[1]


def assert_one_line_error(stderr: str, message: str, max_lines: int = 80, same_everywhere: bool = True) -> int:
    """The job printed `message` once as its one-line error, torchrun names
    the same rank and message as the root cause, no rank printed a
    traceback, and the output is short. Returns the reporting rank.
    `same_everywhere`: every failing rank raised this very error."""
    lines = error_lines(stderr)
    assert len(lines) == 1 and message in lines[0][3], stderr[-5000:]
    rank = int(lines[0][2])
    assert root_cause(stderr) == (rank, lines[0][3]), stderr[-5000:]
    if same_everywhere:
        # Our line and torchrun's root cause; the other ranks' entries say "the same error as rank R".
        assert stderr.count(lines[0][3]) == 2, stderr[-5000:]
    assert not [line for line in stderr.splitlines() if line.startswith("[rank")], stderr[-5000:]
    assert stderr.count("Traceback (most recent call last)") <= 1, stderr[-5000:]  # torchrun's own
    assert len(stderr.splitlines()) <= max_lines, f"{len(stderr.splitlines())} lines:\n{stderr}"
    return rank
