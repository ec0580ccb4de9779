"""Sharded checkpoints over torch.distributed.checkpoint (Megatron-Core's package name).

core: CheckpointError and the collectives that give every rank one verdict.
publish: durable writes and the atomic publish of a checkpoint directory.
checksums: a checksum of every file (crc32c, or zlib crc32 without the extension), computed while writing; the manifest; verification.
vocab_padding: vocabulary rows loaded across a different padding.
states: the checkpoint's entries as DCP Stateful objects (model, optimizer, main params, blobs, RNG).
manager: CheckpointManager, the one owner of a run's saves: one DCP save on its own group, synchronous or
    in the background (--async-save), published when every rank's write finished.
writer: DCP's FileSystemWriter with the checksums in its write results, the manifest and the publish in finish().
torch_dcp: the sharded load of model, optimizer and fp32 main params; the non-tensor entries read alone.
entries: a non-tensor entry of the checkpoint's DCP dict as one checksummed blob.
export: the full weights as one safetensors file.

Training-level checkpoints (tracker, iteration directories, the entries of the one DCP dict) are
megatron_fsdp.training.checkpointing.
"""

from .core import CheckpointError
from .export import export_safetensors
from .manager import CheckpointManager, get_checkpoint_manager, set_checkpoint_manager

__all__ = ["CheckpointError", "CheckpointManager", "export_safetensors", "get_checkpoint_manager",
           "set_checkpoint_manager"]
