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


def assert_one_line_error_in_pool(outcomes: list[tuple], message: str, same_everywhere: bool = True) -> int:
    """A failed job run by the worker pool's ranks (pretrain_in_pool.run_job with `failing`: exit
    code, stdout, stderr and error file of each rank): every rank exited with code 1, exactly one
    printed `message` as the job's one-line error, no rank printed a traceback; each rank's error
    file says what torchrun's summary would show: the line itself for the reporting rank, "the same
    error as rank R" for the others (`same_everywhere`: every rank raised this very error). Returns
    the reporting rank."""
    assert [o[0] for o in outcomes] == [1] * len(outcomes), [(o[0], o[2][-2000:]) for o in outcomes]
    lines = [(rank, m) for rank, o in enumerate(outcomes) for m in error_lines(o[2])]
    assert len(lines) == 1, [o[2][-2000:] for o in outcomes]
    ((rank, match),) = lines
    assert int(match[2]) == rank and message in match[3], match[0]
    assert not [o for o in outcomes if "Traceback (most recent call last)" in o[2]], [o[2][-3000:] for o in outcomes]
    files = [o[3]["message"]["message"] if o[3] else None for o in outcomes]
    assert files[rank] == match[3], files
    if same_everywhere:
        assert all(f == f"the same error as rank {rank}" for r, f in enumerate(files) if r != rank), files
    return rank
