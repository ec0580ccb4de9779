"""The checkpoint's non-tensor entries (train state, LR scheduler, loss scaler,
RNG states, what a model registered): each one blob in the DCP state dict.

A checkpoint is one DCP dict: the model's and optimizer's tensors as DTensor
shards, and beside them one `bytes` value per entry, which DCP stores in a
rank's `.distcp` file. The blob is `torch.save` of the entry's plain state
behind a magic and its CRC-32: torch.load checks no checksum of its own (a
flipped byte can change a value silently), and these entries are read and
checked before the checkpoint's files are verified and before any tensor is
read. They load with `weights_only=True`, as common.pt did.
"""

from __future__ import annotations

import io
import zlib

import torch

from . import safe_unpickle
from .core import CheckpointError

_MAGIC = b"MFSDENT1"  # megatron_fsdp checkpoint entry, layout 1: magic, crc32 (4 bytes, little-endian), torch.save


def pack(state) -> bytes:
    """`state` (plain values and tensors, as a state_dict()) as one checksummed blob."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    return _MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload


def unpack(blob, what: str):
    """The state `pack` wrote; CheckpointError naming `what` when the blob is not one, or is damaged."""
    if not isinstance(blob, (bytes, bytearray)) or bytes(blob[:len(_MAGIC)]) != _MAGIC:
        raise CheckpointError(f"{what} is not a checkpoint entry of this format")
    head = len(_MAGIC)
    crc, payload = int.from_bytes(blob[head:head + 4], "little"), bytes(blob[head + 4:])
    if zlib.crc32(payload) != crc:
        raise CheckpointError(f"{what} is corrupt: checksum mismatch (crc32 {zlib.crc32(payload):08x}, "
                              f"{crc:08x} was written)")
    try:
        return safe_unpickle.load(io.BytesIO(payload), what)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{what} is corrupt ({type(exc).__name__}: {exc})") from exc
