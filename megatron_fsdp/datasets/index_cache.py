"""Dataset index caches: `<hash>-<Class>-<split>-<name>.npy` files plus a description, as Megatron
names them, but each file written to a temporary name and renamed into place, so a reader (another
rank, another job) sees a whole file or none, never a half-written one.

Who builds: without torch.distributed, this process; with it, rank 0 first while the others wait
at the builder's barrier, then the others read. A rank that still finds no cache after the barrier
(a cache directory that is not shared between nodes) builds the same indices itself: they depend
only on the data and the config.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Dict, Iterable, Optional

import numpy

from megatron_fsdp.datasets.utils import log_single_rank
from megatron_fsdp.utils import get_rank_safe

logger = logging.getLogger(__name__)


class IndexCache:
    """The cache files of one dataset: `paths[name]` for each index name and the description."""

    def __init__(self, path_to_cache: Optional[str], base: str, names: Iterable[str]) -> None:
        self.directory = path_to_cache
        self.names = list(names)
        if path_to_cache:
            self.description_path = os.path.join(path_to_cache, f"{base}-description.txt")
            self.paths = {name: os.path.join(path_to_cache, f"{base}-{name}.npy") for name in self.names}
        else:
            self.description_path = None
            self.paths = {}

    def hit(self) -> bool:
        if not self.directory:
            return False
        return all(os.path.isfile(p) for p in [self.description_path, *self.paths.values()])

    def should_build(self) -> bool:
        """Megatron's rule: build when there is no cache, or on rank 0 when the cache is missing."""
        if self.hit():
            return False
        if self.directory and get_rank_safe() != 0:
            log_single_rank(logger, logging.WARNING,
                            f"rank {get_rank_safe()} finds no index cache in {self.directory} after rank 0 built it "
                            "(a directory not shared between nodes?); building the same indices here",
                            rank=get_rank_safe())
        return True

    def load(self) -> Dict[str, numpy.ndarray]:
        return {name: numpy.load(path, allow_pickle=False, mmap_mode="r") for name, path in self.paths.items()}

    def save(self, description: str, arrays: Dict[str, numpy.ndarray]) -> None:
        if not self.directory:
            log_single_rank(logger, logging.WARNING, "indices are not cached: no path_to_cache (--data-cache-path)")
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            # The description goes last: its presence with every array means a complete cache.
            for name in self.names:
                self._atomic_write(self.paths[name], lambda f, a=arrays[name]: numpy.save(f, a, allow_pickle=False))
            self._atomic_write(self.description_path, lambda f: f.write(description.encode("utf-8")))
        except OSError as err:
            raise OSError(f"cannot write dataset index cache files to {self.directory!r} ({err}); give a "
                          "writable directory with --data-cache-path (path_to_cache)") from err

    @staticmethod
    def _atomic_write(path: str, write) -> None:
        directory, name = os.path.split(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the cache from other users of a shared directory
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
