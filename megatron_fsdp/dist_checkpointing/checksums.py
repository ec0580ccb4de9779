"""Checksums of every file a save writes, and their verification on load.

The bytes are checksummed (zlib's crc32, in the standard library) as they
are written: DCP's FileSystemWriter gets a file system whose streams pass
every write through the checksum, so a save reads nothing twice. Each rank
records the files it wrote; rank 0 gathers them into `checksums.json`
inside the checkpoint before it is published. On load the ranks split the
files between them, and a mismatch is raised on every rank, naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import mmap
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from . import core
from .core import CheckpointError
from .publish import write_atomic

MANIFEST_FILENAME = "checksums.json"
ALGORITHM = "crc32"


def crc32_of(data: bytes) -> dict:
    return {"crc32": zlib.crc32(data), "size": len(data)}


# zlib.crc32 and file writes release the GIL: for a large buffer the checksum
# runs on a helper thread while the write copies the same bytes, so it costs
# the longer of the two, not their sum. Small writes are checksummed inline.
_OVERLAP_MIN_BYTES = 1 << 20
_helper: Optional[ThreadPoolExecutor] = None


def _crc_helper() -> ThreadPoolExecutor:
    global _helper
    if _helper is None:
        _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-crc32")
    return _helper


class _ChecksumStream:
    """A write stream that checksums what passes through it."""

    def __init__(self, raw):
        self._raw = raw
        self.crc, self.size = 0, 0

    def write(self, data) -> int:
        if memoryview(data).nbytes < _OVERLAP_MIN_BYTES:
            self.crc = zlib.crc32(data, self.crc)
            written = self._raw.write(data)
        else:
            pending = _crc_helper().submit(zlib.crc32, data, self.crc)
            try:
                written = self._raw.write(data)
            finally:
                # Done with `data` before returning: the caller may reuse its buffer.
                self.crc = pending.result()
        self.size += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def writable(self) -> bool:
        return True


class _ChecksumFileSystem(FileSystem):
    def __init__(self, root: str, record: dict):
        super().__init__()
        self._root, self._record = root, record

    def _name(self, path) -> str:
        return os.path.relpath(str(path), self._root)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = _ChecksumStream(raw)
            yield stream
        self._record[self._name(path)] = {"crc32": stream.crc, "size": stream.size}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes .metadata aside, then renames it
        entry = self._record.pop(self._name(path), None)
        if entry is not None:
            self._record[self._name(new_path)] = entry


class ChecksumFileSystemWriter(FileSystemWriter):
    """DCP's FileSystemWriter, recording {file name: crc32 and size} of every
    file it writes into `record`."""

    def __init__(self, path: str, record: dict, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _ChecksumFileSystem(str(Path(path)), record)


def write_manifest(checkpoint: str, per_rank: list[dict]) -> None:
    files = {}
    for writer_rank, record in enumerate(per_rank):
        for name, entry in record.items():
            files[name] = dict(entry, rank=writer_rank)
    body = {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}
    write_atomic(os.path.join(checkpoint, MANIFEST_FILENAME), json.dumps(body, indent=1).encode())


def read_manifest(checkpoint: str) -> dict:
    """{file name: entry}; raises CheckpointError when it is missing or unreadable."""
    path = os.path.join(checkpoint, MANIFEST_FILENAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {checkpoint} has no {MANIFEST_FILENAME} (saved without checksums, or "
                              "incomplete): load it with verify=False (--no-verify-checkpoint) to skip the check")
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
        if body.get("algorithm") != ALGORITHM:
            raise ValueError(f"unknown checksum algorithm {body.get('algorithm')!r}")
        return body["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: {MANIFEST_FILENAME} is corrupt ({exc})") from exc


def _file_problem(checkpoint: str, name: str, entry: dict) -> Optional[str]:
    path = os.path.join(checkpoint, name)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                crc = 0
            else:
                # Mapped, not read: the checksum is then the only pass over the bytes.
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    crc = zlib.crc32(mapped)
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as exc:
        return f"{path}: cannot be read ({type(exc).__name__}: {exc})"
    if size != entry["size"]:
        return f"{path}: {size} bytes, {entry['size']} were written"
    if crc != entry["crc32"]:
        return f"{path}: checksum mismatch (crc32 {crc:08x}, {entry['crc32']:08x} was written)"
    return None


def _share(files: dict, ranks: int) -> list[list[str]]:
    """Split the files between the ranks by size, the largest first, the same way on every rank."""
    shares, loads = [[] for _ in range(ranks)], [0] * ranks
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        r = loads.index(min(loads))
        shares[r].append(name)
        loads[r] += files[name]["size"]
    return shares


def verify(checkpoint: str, files: dict) -> None:
    """Every rank checks its share of `files` (the manifest rank 0 read);
    then every rank raises the same CheckpointError naming each bad file."""
    mine = _share(files, core.world_size())[core.rank()]
    problems = [p for p in (_file_problem(checkpoint, n, files[n]) for n in mine) if p]
    found = sorted(p for share in core.all_gather(problems) for p in share)
    if found:
        shown = "\n  ".join(found[:10]) + ("\n  ..." if len(found) > 10 else "")
        raise CheckpointError(f"checkpoint {checkpoint} is corrupt: a file differs from what was saved:\n  {shown}")
