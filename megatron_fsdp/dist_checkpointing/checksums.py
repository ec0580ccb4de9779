"""Checksums of every file a save writes, and their verification on load.

The bytes are checksummed as they are written: DCP's FileSystemWriter gets
a file system whose streams pass every write through the checksum, so a
save reads nothing twice. Each rank records the files it wrote, and DCP's
own gather brings them to the coordinator, which writes them into
`checksums.json` inside the checkpoint before it is published (writer.py). On load the ranks split the files between them, and a mismatch
is raised on every rank, naming the file.

The algorithm is CRC-32C when the megatron_fsdp extension is built (the
CPU's crc32 instruction, about 10 GB/s per core), else zlib's CRC-32 (about
1-3 GB/s). Each file's entry names its algorithm ({"crc32c": value, "size":
n}), and loads verify with the recorded one, so checkpoints written with
either (or by an older version, all CRC-32) keep verifying. Verifying
CRC-32C without the extension works, slowly (pure PyTorch, ~0.1 GB/s), and
warns once.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from torch.distributed.checkpoint.filesystem import FileSystem

from ..utils import all_gather_objects, get_rank_safe, get_world_size_safe
from .core import CheckpointError
from .publish import write_atomic

MANIFEST_FILENAME = "checksums.json"
ALGORITHMS = ("crc32c", "crc32")
_MIXED = "mixed"  # the manifest's algorithm when ranks used different ones
_warned_slow_crc32c = False


def _kernels():
    """megatron_fsdp.kernels at the first checksum, not when the training loop is imported: loading
    the extension runs its build check in a child process (kernels/extension.py)."""
    from .. import kernels

    return kernels


def save_algorithm() -> str:
    """What new saves record: crc32c with the extension, else zlib's crc32."""
    return "crc32c" if _kernels().extension_available() else "crc32"


def _function(algorithm: str):
    """f(data, value) -> int for a recorded algorithm."""
    global _warned_slow_crc32c
    if algorithm == "crc32":
        return zlib.crc32
    if not _kernels().extension_available() and not _warned_slow_crc32c:
        _warned_slow_crc32c = True
        warnings.warn("verifying CRC-32C checkpoint checksums without the megatron_fsdp extension "
                      f"({_kernels().extension_import_error()}): the pure-PyTorch CRC-32C runs at about 0.1 GB/s. "
                      "Build the extension (scripts/env.sh), or skip the check with --no-verify-checkpoint "
                      "(load_checkpoint(verify=False))", RuntimeWarning, stacklevel=3)
    return _kernels().crc32c


def checksum_of(data) -> dict:
    """The manifest entry of a file holding `data` (any bytes-like object)."""
    algorithm = save_algorithm()
    return {algorithm: _function(algorithm)(data, 0), "size": memoryview(data).nbytes}



def entry_algorithm(entry: dict) -> str:
    found = [a for a in ALGORITHMS if a in entry]
    if len(found) != 1:
        raise ValueError(f"an entry must hold exactly one of {', '.join(ALGORITHMS)}, got keys {sorted(entry)}")
    return found[0]


# The checksums and file writes release the GIL: for a large buffer the
# checksum runs on a helper thread while the write copies the same bytes, so
# it costs the longer of the two, not their sum. Small writes are checksummed
# inline.
_OVERLAP_MIN_BYTES = 1 << 20
_helper: Optional[ThreadPoolExecutor] = None


def _crc_helper() -> ThreadPoolExecutor:
    global _helper
    if _helper is None:
        _helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-checksum")
    return _helper


class _ChecksumStream:
    """A write stream that checksums what passes through it."""

    def __init__(self, raw, algorithm: str):
        self._raw = raw
        self.algorithm, self._crc_of = algorithm, _function(algorithm)
        self.crc, self.size = 0, 0

    def write(self, data) -> int:
        if memoryview(data).nbytes < _OVERLAP_MIN_BYTES:
            self.crc = self._crc_of(data, self.crc)
            written = self._raw.write(data)
        else:
            pending = _crc_helper().submit(self._crc_of, data, self.crc)
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


class ChecksumFileSystem(FileSystem):
    """DCP's file system, recording {file name: checksum entry} of every file written through it into `record`."""

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
            stream = _ChecksumStream(raw, save_algorithm())
            yield stream
        self._record[self._name(path)] = {stream.algorithm: stream.crc, "size": stream.size}

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes .metadata aside, then renames it
        entry = self._record.pop(self._name(path), None)
        if entry is not None:
            self._record[self._name(new_path)] = entry


def write_manifest(checkpoint: str, per_rank: list[dict]) -> None:
    files = {}
    for writer_rank, record in enumerate(per_rank):
        for name, entry in record.items():
            files[name] = dict(entry, rank=writer_rank)
    algorithms = {entry_algorithm(entry) for entry in files.values()} or {save_algorithm()}
    body = {"algorithm": algorithms.pop() if len(algorithms) == 1 else _MIXED, "files": dict(sorted(files.items()))}
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
        algorithm = body.get("algorithm")
        if algorithm not in ALGORITHMS + (_MIXED,):
            raise ValueError(f"unknown checksum algorithm {algorithm!r}; this version verifies "
                             f"{', '.join(ALGORITHMS)}")
        files = body["files"]
        for name, entry in files.items():
            found = entry_algorithm(entry)
            if algorithm != _MIXED and found != algorithm:
                raise ValueError(f"{name}: a {found} entry in a {algorithm} manifest")
            if not isinstance(entry[found], int) or not isinstance(entry.get("size"), int):
                raise ValueError(f"{name}: checksum and size must be integers, got {entry}")
        return files
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {checkpoint}: {MANIFEST_FILENAME} is corrupt ({exc})") from exc


def _file_problem(checkpoint: str, name: str, entry: dict) -> Optional[str]:
    path = os.path.join(checkpoint, name)
    algorithm = entry_algorithm(entry)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                crc = 0
            else:
                # Mapped, not read: the checksum is then the only pass over the bytes.
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    crc = _function(algorithm)(mapped, 0)
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as exc:
        return f"{path}: cannot be read ({type(exc).__name__}: {exc})"
    if size != entry["size"]:
        return f"{path}: {size} bytes, {entry['size']} were written"
    if crc != entry[algorithm]:
        return f"{path}: checksum mismatch ({algorithm} {crc:08x}, {entry[algorithm]:08x} was written)"
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
    mine = _share(files, get_world_size_safe())[get_rank_safe()]
    problems = [p for p in (_file_problem(checkpoint, n, files[n]) for n in mine) if p]
    found = sorted(p for share in all_gather_objects(problems) for p in share)
    if found:
        # The first line is what a job's one-line error shows: it names the first bad file.
        # The rest follow in the full message (torchrun's error file, MEGATRON_FSDP_TRACEBACKS=1).
        more = f" (and {len(found) - 1} more file(s), in the full error)" if len(found) > 1 else ""
        rest = "".join(f"\n  {p}" for p in found[1:10]) + ("\n  ..." if len(found) > 10 else "")
        raise CheckpointError(f"checkpoint {checkpoint} is corrupt: a file differs from what was saved: "
                              f"{found[0]}{more}{rest}")
