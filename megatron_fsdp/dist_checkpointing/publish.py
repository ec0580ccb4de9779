"""Durable writes and the atomic publish of a checkpoint directory.

A directory is written under `<final>.tmp-<run>-<id>` and renamed to
`<final>` only once complete; re-publishing an existing `<final>` first sets
the old copy aside as `<final>.old-<run>-<id>` (readers fall back to it) and
removes it last. Every rename is followed by an fsync of the parent
directory, without which POSIX does not promise the rename survives a crash.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from typing import Callable, Optional

from .core import CheckpointError

# Names this process's temporary and set-aside directories. Only rank 0
# creates them, so it identifies the job: a later run (or a restart) can tell
# what earlier runs' crashed saves left from what its own saves hold.
_RUN_ID = uuid.uuid4().hex[:8]
_ASIDE = re.compile(r"(.+?)\.(tmp|old)-(.+)")


def fsync_dir(path: str) -> None:
    """Make renames and new entries in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Filesystems that cannot sync a directory offer nothing stronger to ask for.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_durable(path: str, data: bytes) -> None:
    """`data` to `path`, flushed and fsynced: on disk before the caller renames it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` with `data`: readers see the old or the new file, never a part."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


@contextlib.contextmanager
def output_directory(path: str):
    """Inside: `path` exists (created if missing, with its missing parents). If the body raises,
    the directories created here are removed again while they are empty: a failed write leaves
    nothing where it was to go."""
    created = []  # deepest first
    missing = os.path.abspath(path)
    while not os.path.isdir(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(path, exist_ok=True)
    try:
        yield path
    except BaseException:
        for directory in created:
            try:
                os.rmdir(directory)  # only if empty
            except OSError:
                break
        raise


def run_id() -> str:
    """This process's name for the directories its saves create (the manager shares rank 0's)."""
    return _RUN_ID


def checkpoint_dir(root: str, iteration: int) -> str:
    """Megatron's name of a checkpoint: <root>/iter_0000100."""
    return os.path.join(root, f"iter_{iteration:07d}")


def is_complete(path: str) -> bool:
    """A checkpoint directory whose save finished: DCP writes its .metadata after every rank's
    data; format 2 wrote common.pt last."""
    return os.path.isfile(os.path.join(path, ".metadata")) and (
        os.path.isfile(os.path.join(path, "common.pt")) or not os.path.isdir(os.path.join(path, "rng")))


def temp_dir_for(final: str, run: Optional[str] = None, number: Optional[int] = None) -> str:
    """Where `final` is written before it is published: named by the run (`run`, this
    process's by default) and, for a name every rank computes alike, the save's `number`."""
    suffix = uuid.uuid4().hex[:8] if number is None else str(number)
    return f"{final}.tmp-{run or _RUN_ID}-{suffix}"


def set_aside_copies(final: str) -> list[str]:
    """Complete-looking set-aside copies of `final` (a re-publish between, or
    crashed between, its two renames), newest last."""
    parent, name = os.path.split(final)
    found = [os.path.join(parent, e) for e in os.listdir(parent) if e.startswith(f"{name}.old-")]
    return sorted(found, key=os.path.getmtime)


def clean_stale(parent: str, is_complete: Callable[[str], bool], run: Optional[str] = None) -> None:
    """Remove what crashed publishes of earlier runs left in `parent` (call on
    one rank). This run's own names belong to a save in progress. A set-aside
    copy whose final directory is missing is the only copy (the crash came
    between the two renames of a re-publish): it is put back."""
    for entry in sorted(os.listdir(parent)):
        match = _ASIDE.fullmatch(entry)
        path = os.path.join(parent, entry)
        if match is None or not os.path.isdir(path) or match.group(3).startswith(f"{run or _RUN_ID}-"):
            continue
        final = os.path.join(parent, match.group(1))
        if match.group(2) == "old" and not os.path.exists(final) and is_complete(path):
            os.replace(path, final)
            fsync_dir(parent)
        else:
            shutil.rmtree(path, ignore_errors=True)


TRACKER_FILENAME = "latest_checkpointed_iteration.txt"  # Megatron's: the latest iteration's number


def write_tracker(save_dir: str, iteration: int) -> None:
    """Name `iteration` the latest checkpoint of `save_dir` (atomically, durably)."""
    write_atomic(os.path.join(save_dir, TRACKER_FILENAME), f"{iteration}\n".encode())


def read_tracker(load_dir: str) -> Optional[int]:
    """The iteration `load_dir`'s tracker names, or None without a tracker."""
    tracker = os.path.join(load_dir, TRACKER_FILENAME)
    try:
        with open(tracker) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number")
    return int(text)


def publish(tmp: str, final: str, then: Optional[Callable[[], None]] = None) -> None:
    """Rename the finished `tmp` to `final`, run `then` (the tracker update),
    and only then remove the set-aside old copy, so there is no moment
    without a complete copy under a name readers look for."""
    parent = os.path.dirname(final) or "."
    for sub in sorted(os.listdir(tmp)):
        if os.path.isdir(os.path.join(tmp, sub)):
            fsync_dir(os.path.join(tmp, sub))
    fsync_dir(tmp)
    old = None
    if os.path.exists(final):
        old = f"{final}.old-{_RUN_ID}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:
            os.replace(old, final)
        raise
    fsync_dir(parent)
    if then is not None:
        then()
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
