"""Hugging Face model directories, read and written tensor by tensor.

A directory holds `config.json` and the weights in safetensors: one
`model.safetensors`, or shards `model-0000k-of-0000n.safetensors` that
`model.safetensors.index.json` maps each tensor to. The safetensors format
(an 8-byte header length, a JSON header of dtypes, shapes and byte offsets,
the raw bytes) is read and written here directly: reading one tensor reads
its bytes only, and writing holds one shard at a time.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from typing import Callable, Optional

import torch

from .core import CheckpointError
from .publish import fsync_dir

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
CONFIG, INDEX, SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"


class SafetensorsFile:
    """One safetensors file: its header, and each tensor read alone."""

    def __init__(self, path: str):
        """Reads and checks the header against the file's size: a file of other bytes, or one cut
        short, is refused here, in one line naming it, before any tensor is read or written."""
        self.path = path
        try:
            with open(path, "rb") as f:
                file_size = os.fstat(f.fileno()).st_size
                size = int.from_bytes(f.read(8), "little")
                if file_size < 8 or size > file_size - 8:
                    raise CheckpointError(f"{path}: not a safetensors file: its header would be {size} bytes, the "
                                          f"file has {file_size}")
                header = json.loads(f.read(size))
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot be read ({exc})") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: not a safetensors file: its header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: not a safetensors file: its header is not a JSON object")
        header.pop("__metadata__", None)
        for name, entry in header.items():
            self._check_entry(name, entry, file_size - 8 - size)
        self._header, self._start = header, 8 + size

    def _check_entry(self, name: str, entry, data_size: int) -> None:
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
            dtype = entry.get("dtype") if isinstance(entry, dict) else entry
            raise CheckpointError(f"{self.path}: tensor {name} has dtype {dtype!r}, not one of {sorted(DTYPES)}")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape)
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in offsets)):
            raise CheckpointError(f"{self.path}: tensor {name}'s header entry is malformed ({entry})")
        begin, end = offsets
        nbytes = math.prod(shape) * torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()  # any size
        if not 0 <= begin <= end or end - begin != nbytes:
            raise CheckpointError(f"{self.path}: tensor {name} spans bytes {begin}-{end}, its shape {shape} and "
                                  f"dtype {entry['dtype']} need {nbytes}")
        if end > data_size:
            raise CheckpointError(f"{self.path}: truncated: tensor {name} ends at byte {end} of the data, the file "
                                  f"holds {data_size}")

    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._header[name]["dtype"]]

    def tensor(self, name: str) -> torch.Tensor:
        begin, end = self._header[name]["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self._start + begin)
            data = bytearray(f.read(end - begin))
        if len(data) != end - begin:
            raise CheckpointError(f"{self.path}: tensor {name} is truncated ({len(data)} of {end - begin} bytes)")
        if not data:
            return torch.empty(self.shape(name), dtype=self.dtype(name))
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype(name)).reshape(self.shape(name))


def safetensors_header(spec: dict[str, tuple[torch.Size, torch.dtype]], metadata: Optional[dict] = None) -> bytes:
    """The start of a safetensors file holding `spec`'s tensors ({name: (shape, dtype)}) in that
    order: the header's length, then the header, padded so that the data is 8-byte aligned."""
    header, offset = {}, 0
    for name, (shape, dtype) in spec.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> None:
    """Write `tensors` (CPU, contiguous) as one safetensors file, fsynced."""
    with open(path, "wb") as f:
        f.write(safetensors_header({name: (t.shape, t.dtype) for name, t in tensors.items()}, metadata))
        for t in tensors.values():
            f.write(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


class HFDirectory:
    """A Hugging Face model directory opened for reading; every file named is checked first."""

    def __init__(self, path: str):
        self.path = path
        config_path = os.path.join(path, CONFIG)
        if not os.path.isfile(config_path):
            raise CheckpointError(f"{path} has no {CONFIG}: not a Hugging Face model directory")
        self.config = _read_json(config_path)
        index_path = os.path.join(path, INDEX)
        if os.path.isfile(index_path):
            weight_map = _read_json(index_path).get("weight_map") or {}
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise CheckpointError(f"{index_path}: its weight_map is not an object of tensor names to file names")
            missing = sorted({file for file in weight_map.values() if not os.path.isfile(os.path.join(path, file))})
            if missing:
                raise CheckpointError(f"{index_path} names {', '.join(missing)}, which {path} does not hold")
        elif os.path.isfile(os.path.join(path, SINGLE)):
            weight_map = None
        else:
            raise CheckpointError(f"{path} holds neither {SINGLE} nor {INDEX}")
        files = {}
        self._where: dict[str, SafetensorsFile] = {}
        for name, file in (weight_map or {}).items():
            files.setdefault(file, SafetensorsFile(os.path.join(path, file)))
            if name not in files[file].names():
                raise CheckpointError(f"{index_path} maps {name} to {file}, which does not hold it")
            self._where[name] = files[file]
        if weight_map is None:
            single = SafetensorsFile(os.path.join(path, SINGLE))
            self._where = {name: single for name in single.names()}

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> torch.Size:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._file(name).dtype(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self._file(name).tensor(name)

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._where:
            raise CheckpointError(f"{self.path} holds no tensor {name}")
        return self._where[name]


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            found = json.load(f)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None
    except ValueError as exc:  # json's errors (and a file that is not UTF-8)
        raise CheckpointError(f"{path}: not JSON ({exc})") from None
    if not isinstance(found, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(found).__name__}, not an object")
    return found


def shard_names(spec: dict[str, tuple[torch.Size, torch.dtype]], max_shard_bytes: int) -> list[list[str]]:
    """The tensors of `spec` in order, cut into shards of at most `max_shard_bytes` (a bigger tensor alone)."""
    shards, current, size = [], [], 0
    for name, (shape, dtype) in spec.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return shards + ([current] if current else [])


def write_hf_directory(save_dir: str, config: dict, spec: dict[str, tuple[torch.Size, torch.dtype]],
                       produce: Callable[[str], torch.Tensor], *, max_shard_bytes: int,
                       extra_files: tuple[str, ...] = ()) -> None:
    """Write a Hugging Face model directory: config.json, the tensors of `spec` ({name: (shape,
    dtype)}; `produce(name)` makes each, one shard in memory at a time) in one file or in shards
    with an index, and `extra_files` copied in (tokenizer files). Written aside and renamed:
    `save_dir` must not exist, or be empty."""
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise CheckpointError(f"{save_dir} exists and is not an empty directory: not overwriting it")
    parent = os.path.dirname(os.path.abspath(save_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(save_dir))}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    try:
        shards = shard_names(spec, max_shard_bytes)
        files = [SINGLE] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                                   for k in range(len(shards))]
        weight_map, total = {}, 0
        for file, names in zip(files, shards):
            tensors = {}
            for name in names:
                shape, dtype = spec[name]
                t = produce(name).detach().to("cpu", dtype).contiguous()
                if tuple(t.shape) != tuple(shape):
                    raise CheckpointError(f"{name}: made with shape {list(t.shape)}, expected {list(shape)}")
                tensors[name] = t
                weight_map[name] = file
                total += t.numel() * t.element_size()
            write_safetensors(os.path.join(tmp, file), tensors)
            del tensors
        if len(files) > 1:
            with open(os.path.join(tmp, INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        for extra in extra_files:
            shutil.copy(extra, os.path.join(tmp, os.path.basename(extra)))
        fsync_dir(tmp)
        if os.path.isdir(save_dir):
            os.rmdir(save_dir)  # empty (checked above)
        os.rename(tmp, save_dir)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
