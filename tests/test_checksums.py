"""CRC-32C (csrc/crc32c.cpp and its pure-PyTorch fallback) and the
checkpoint checksum manifest that records which algorithm wrote it."""

import json
import mmap
import os
import random
import warnings
import zlib

import numpy as np
import pytest
import torch
from torch import nn

from megatron_fsdp import kernels
from megatron_fsdp.dist_checkpointing import checksums
from megatron_fsdp.dist_checkpointing.core import CheckpointError
from megatron_fsdp.kernels import crc
from megatron_fsdp.training.checkpointing import load_checkpoint, save_checkpoint

# RFC 3720 (iSCSI), appendix B.4, and the common check value.
VECTORS = [
    (b"", 0),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


def _bitwise_crc32c(data: bytes, value: int = 0) -> int:
    """The definition, one bit at a time: independent of every table."""
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _implementations():
    impls = {"fallback": crc.crc32c_reference}
    if kernels.extension_available():
        ext = kernels._load_extension()
        impls["extension"] = ext.crc32c
        impls["portable"] = ext.crc32c_portable
    return impls


IMPLS = ["extension", "portable", "fallback"]


def _impl(name):
    impls = _implementations()
    if name not in impls:
        pytest.skip(f"extension not built: {kernels.extension_import_error()}")
    return impls[name]


@pytest.mark.parametrize("name", IMPLS)
def test_known_vectors(name):
    f = _impl(name)
    for data, expected in VECTORS:
        assert f(data) == expected == _bitwise_crc32c(data), data


@pytest.mark.parametrize("name", IMPLS)
def test_random_lengths_offsets_and_continuation(name):
    f = _impl(name)
    rng = random.Random(0)
    blob = bytes(rng.getrandbits(8) for _ in range(200_000))
    # Around the 3-way blocks (3 x 256, 3 x 8192 bytes) and the fallback's lanes.
    lengths = [0, 1, 7, 8, 9, 767, 768, 769, 24575, 24576, 24577, 3 * 8192 + 3 * 256 + 13, 16383, 16384, 65537,
               199_990]
    for n in lengths:
        offset = rng.randrange(0, 8)
        data = blob[offset:offset + n]
        expected = _bitwise_crc32c(data) if n <= 30_000 else crc.crc32c_reference(data)
        assert f(data) == expected, (n, offset)
        cut = rng.randrange(0, n + 1)
        assert f(data[cut:], f(data[:cut])) == expected, (n, offset, cut)
    # ~2.9 MB (many lanes and blocks of the fallback) against 4 KiB pieces
    # chained, which the fallback computes with its plain byte loop.
    block = bytes(rng.getrandbits(8) for _ in range(1 << 12))
    chained = 0
    for _ in range(700):
        chained = f(block, chained)
    assert f(block * 700) == chained


def test_extension_and_fallback_agree_on_large_data():
    ext = _impl("extension")
    data = np.random.default_rng(1).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    assert ext(data) == crc.crc32c_reference(data) == _impl("portable")(data)


def test_uses_the_crc32_instruction_where_the_cpu_has_it():
    _impl("extension")
    try:
        with open("/proc/cpuinfo") as f:
            has_sse42 = " sse4_2" in f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if os.uname().machine == "x86_64":
        assert kernels._load_extension().crc32c_uses_hardware() == has_sse42


@pytest.mark.parametrize("name", IMPLS)
def test_buffers_and_bad_arguments(name, tmp_path):
    f = _impl(name)
    data = bytes(range(256)) * 10
    expected = _bitwise_crc32c(data)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert f(mapped) == expected
    array = np.frombuffer(data, dtype=np.float32)
    for buffer in (bytearray(data), memoryview(data), array, array.reshape(20, -1)):
        assert f(buffer) == expected
    with pytest.raises((ValueError, BufferError, TypeError)):
        f(array[::2])  # not contiguous
    with pytest.raises(TypeError):
        f("text")
    with pytest.raises(ValueError, match=r"value must be in \[0, 2\*\*32\)"):
        f(data, -1)
    with pytest.raises(ValueError, match=r"value must be in \[0, 2\*\*32\)"):
        f(data, 1 << 32)
    assert f(data, 0xFFFFFFFF) == _bitwise_crc32c(data, 0xFFFFFFFF)


def test_the_public_function_uses_the_extension_when_built(monkeypatch):
    _impl("extension")

    def unexpected(data, value=0):
        raise AssertionError("the fallback ran although the extension is built")

    monkeypatch.setattr(crc, "crc32c_reference", unexpected)
    assert kernels.crc32c(b"123456789") == 0xE3069283
    monkeypatch.undo()
    monkeypatch.setattr(crc, "extension_available", lambda: False)
    monkeypatch.setattr(crc, "crc32c_reference", lambda data, value=0: 12345)
    assert kernels.crc32c(b"123456789") == 12345


# ---- the manifest: which algorithm wrote it, and verification with that one ----


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))


def _manifest(path):
    with open(os.path.join(path, checksums.MANIFEST_FILENAME)) as f:
        return json.load(f)


def _flip_byte(path, name):
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(50)
        byte = f.read(1)
        f.seek(50)
        f.write(bytes([byte[0] ^ 0x01]))


def _without_extension(monkeypatch):
    monkeypatch.setattr(kernels, "extension_available", lambda: False)
    monkeypatch.setattr(crc, "extension_available", lambda: False)
    monkeypatch.setattr(checksums, "_warned_slow_crc32c", False)


def test_saves_record_crc32c_and_verify_it(tmp_path):
    _impl("extension")
    model = _model()
    path = save_checkpoint(1, model, None, None, str(tmp_path))
    manifest = _manifest(path)
    assert manifest["algorithm"] == "crc32c"
    for name, entry in manifest["files"].items():
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        assert entry["crc32c"] == crc.crc32c_reference(data), name
        assert entry["size"] == len(data)
    assert load_checkpoint(model, None, None, str(tmp_path))["iteration"] == 1
    _flip_byte(path, ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata: checksum mismatch \(crc32c "):
        load_checkpoint(model, None, None, str(tmp_path))


def test_crc32_checkpoints_still_verify(tmp_path, monkeypatch):
    # What a save without the extension (and every save before crc32c) wrote.
    model = _model()
    monkeypatch.setattr(checksums, "save_algorithm", lambda: "crc32")
    path = save_checkpoint(1, model, None, None, str(tmp_path))
    monkeypatch.undo()
    manifest = _manifest(path)
    assert manifest["algorithm"] == "crc32"
    for name, entry in manifest["files"].items():
        with open(os.path.join(path, name), "rb") as f:
            assert entry == {"crc32": zlib.crc32(f.read()), "size": entry["size"], "rank": 0}
    assert load_checkpoint(model, None, None, str(tmp_path))["iteration"] == 1
    _flip_byte(path, ".metadata")
    with pytest.raises(CheckpointError, match=r"\.metadata: checksum mismatch \(crc32 "):
        load_checkpoint(model, None, None, str(tmp_path))


def test_without_the_extension_saves_use_crc32_and_crc32c_verifies_slowly(tmp_path, monkeypatch):
    _impl("extension")
    model = _model()
    crc32c_path = save_checkpoint(1, model, None, None, str(tmp_path / "a"))
    _without_extension(monkeypatch)
    assert _manifest(save_checkpoint(1, model, None, None, str(tmp_path / "b")))["algorithm"] == "crc32"
    with pytest.warns(RuntimeWarning, match="pure-PyTorch CRC-32C.*--no-verify-checkpoint"):
        assert load_checkpoint(model, None, None, str(tmp_path / "a"))["iteration"] == 1
    _flip_byte(crc32c_path, ".metadata")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # warned once per process
        with pytest.raises(CheckpointError, match=r"\.metadata: checksum mismatch \(crc32c "):
            load_checkpoint(model, None, None, str(tmp_path / "a"))


@pytest.mark.parametrize("change", ["algorithm", "entry"])
def test_unknown_or_inconsistent_algorithms_are_named(tmp_path, change):
    model = _model()
    path = save_checkpoint(1, model, None, None, str(tmp_path))
    manifest = _manifest(path)
    if change == "algorithm":
        manifest["algorithm"] = "md5"
        message = "unknown checksum algorithm 'md5'; this version verifies crc32c, crc32"
    else:
        name = sorted(manifest["files"])[0]
        entry = manifest["files"][name]
        manifest["files"][name] = {"sha1": 1, "size": entry["size"]}
        message = "an entry must hold exactly one of crc32c, crc32"
    with open(os.path.join(path, checksums.MANIFEST_FILENAME), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match=f"checksums.json is corrupt.*{message}"):
        load_checkpoint(model, None, None, str(tmp_path))


def test_ranks_with_different_algorithms_write_a_mixed_manifest(tmp_path):
    # One rank without the extension must not make the checkpoint unverifiable.
    blob_a, blob_b = b"a" * 100, b"b" * 50
    (tmp_path / "a").write_bytes(blob_a)
    (tmp_path / "b").write_bytes(blob_b)
    per_rank = [{"a": {"crc32c": _bitwise_crc32c(blob_a), "size": 100}},
                {"b": {"crc32": zlib.crc32(blob_b), "size": 50}}]
    checksums.write_manifest(str(tmp_path), per_rank)
    files = checksums.read_manifest(str(tmp_path))
    assert _manifest(str(tmp_path))["algorithm"] == "mixed"
    checksums.verify(str(tmp_path), files)
    (tmp_path / "b").write_bytes(b"c" * 50)
    with pytest.raises(CheckpointError, match=r"b: checksum mismatch \(crc32 "):
        checksums.verify(str(tmp_path), files)
