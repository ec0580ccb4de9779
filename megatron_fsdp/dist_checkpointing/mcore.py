"""Megatron-Core's torch_dist checkpoints of a GPT, read and written tensor by tensor.

What megatron-core 0.19's dist_checkpointing writes (the layout Megatron-LM's
save_checkpoint gives it; tests/data/mcore_torch_dist was written by it):

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000003/metadata.json     {"sharded_backend": "torch_dist", ...}
    <dir>/iter_0000003/.metadata, __*_*.distcp   one DCP checkpoint:
        embedding.word_embeddings.weight, decoder.final_layernorm.weight, output_layer.weight
        decoder.layers.<name>                       every layer's tensor stacked on a leading
                                                    layer dimension, no layer index in the key
        decoder.layers.<name>._extra_state/shard_i_L   each layer's module extra state
        common_state/shard_0_1                      [{"args": Namespace, "iteration", "checkpoint_version"}]

The layer norms carry Transformer Engine's names whatever the layer spec
(input_layernorm -> self_attention.linear_qkv.layer_norm_weight,
pre_mlp_layernorm -> mlp.linear_fc1.layer_norm_weight); older local-spec
checkpoints kept ours, and are read too. Fused QKV (per query group) and fc1
([gate; up]) hold the same full layout as ours. The vocabulary rows are
Megatron's padding for the run that saved them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
from typing import Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from . import publish
from .core import CheckpointError, describe, this_process_alone
from .lazy_save import LazySavePlanner, as_planned
from .safe_unpickle import MEGATRON_CORE_GLOBALS, SafeFileSystemReader, SafeLoadPlanner, load as safe_load

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
          "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
          "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
# The modules whose extra state (Transformer Engine's fp8 metadata) a checkpoint holds per layer:
# the four linears of either spec, and TE's core attention (a local-spec load ignores it).
_EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1",
                        "mlp.linear_fc2", "self_attention.core_attention")
COMMON = "common_state/shard_0_1"


def mcore_key(name: str) -> tuple[str, Optional[int]]:
    """Our parameter name -> (Megatron-Core's key, layer index in its stacked tensor or None)."""
    m = _LAYER.match(name)
    if m is None:
        return name, None
    rest = m[2]
    return "decoder.layers." + _NORMS.get(rest, rest), int(m[1])


def _local_spec_key(name: str) -> str:
    m = _LAYER.match(name)
    return name if m is None else "decoder.layers." + m[2]


def _iteration_dir(path: str, iteration: Optional[int]) -> tuple[str, int]:
    if iteration is None:
        iteration = publish.read_tracker(path)
        if iteration is None:
            if os.path.isfile(os.path.join(path, "metadata.json")):  # an iter_* directory itself
                match = re.search(r"iter_(\d+)$", os.path.abspath(path))
                return path, int(match[1]) if match else 0
            raise CheckpointError(f"{path} has no {publish.TRACKER_FILENAME}: not a Megatron checkpoint directory")
    return os.path.join(path, f"iter_{iteration:07d}"), iteration


class _SliceReads(SafeLoadPlanner):
    """Reads one row block of a stored tensor (a layer of a stacked one) into `dest`."""

    def __init__(self, key: str, chunk: ChunkStorageMetadata, dest: torch.Tensor):
        super().__init__()
        self._key, self._chunk, self._dest = key, chunk, dest

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(create_read_items_for_chunk_list(self._key, self.metadata.state_dict_metadata[self._key],
                                                         [self._chunk]))

    def lookup_tensor(self, index):
        return self._dest


class McoreReader:
    """A Megatron-Core torch_dist checkpoint opened for reading (no collective)."""

    def __init__(self, path: str, iteration: Optional[int] = None):
        self.path, self.iteration = _iteration_dir(path, iteration)
        meta_path = os.path.join(self.path, "metadata.json")
        try:
            with open(meta_path) as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: cannot read metadata.json ({exc}): not a Megatron-Core "
                                  "distributed checkpoint") from exc
        if backend != "torch_dist":
            raise CheckpointError(f"{self.path}: sharded_backend {backend!r}; only torch_dist is read")
        self._reader = SafeFileSystemReader(self.path)
        try:
            self._metadata = self._reader.read_metadata().state_dict_metadata
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot read its DCP metadata ({describe(exc)})") from None
        self.common = self._common()
        args = self.common.get("args")
        self.args = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args or {})

    def _common(self) -> dict:
        """The common state, unpickled as Megatron-Core unpickles it (safe_unpickle): never runs code."""
        common_pt = os.path.join(self.path, "common.pt")
        if os.path.isfile(common_pt):  # Megatron-Core's earlier layout
            with open(common_pt, "rb") as f:
                return safe_load(f, common_pt, MEGATRON_CORE_GLOBALS)
        if COMMON not in self._metadata:
            return {}
        found = {COMMON: io.BytesIO()}
        try:
            with this_process_alone():
                dcp.load(found, storage_reader=self._reader, no_dist=True,
                         planner=SafeLoadPlanner(allowed=MEGATRON_CORE_GLOBALS))
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"{self.path}: cannot read its common state ({describe(exc)})") from None
        value = found[COMMON]
        if isinstance(value, io.BytesIO):
            value.seek(0)
            value = safe_load(value, f"{self.path}: common state", MEGATRON_CORE_GLOBALS)
        return value[0] if isinstance(value, list) else value

    def locate(self, name: str) -> tuple[str, Optional[int]]:
        """Where our tensor `name` is stored: (key, layer index or None); raises if nowhere."""
        key, layer = mcore_key(name)
        if key not in self._metadata and layer is not None and _local_spec_key(name) in self._metadata:
            key = _local_spec_key(name)
        if not isinstance(self._metadata.get(key), TensorStorageMetadata):
            raise CheckpointError(f"{self.path} holds no tensor {key} (for {name})")
        return key, layer

    def shape(self, name: str) -> torch.Size:
        key, layer = self.locate(name)
        size = torch.Size(self._metadata[key].size)
        return size[1:] if layer is not None else size

    def dtype(self, name: str) -> torch.dtype:
        return self._metadata[self.locate(name)[0]].properties.dtype

    def layers(self) -> int:
        return int(self._metadata["decoder.layers.self_attention.linear_qkv.weight"].size[0])

    def tensor(self, name: str) -> torch.Tensor:
        key, layer = self.locate(name)
        size = torch.Size(self._metadata[key].size)
        if layer is None:
            chunk, dest = ChunkStorageMetadata(torch.Size([0] * len(size)), size), torch.empty(size, dtype=self.dtype(name))
        else:
            chunk = ChunkStorageMetadata(torch.Size([layer] + [0] * (len(size) - 1)), torch.Size([1, *size[1:]]))
            dest = torch.empty((1, *size[1:]), dtype=self.dtype(name))
        try:
            with this_process_alone():
                dcp.load({key: dest}, storage_reader=self._reader, planner=_SliceReads(key, chunk, dest), no_dist=True)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"{self.path}: cannot read {key} ({describe(exc)})") from exc
        return dest[0] if layer is not None else dest


class _StackedSavePlanner(LazySavePlanner):
    """Writes each stacked key layer by layer, each layer's tensor (our name) produced when it is
    written; an unstacked tensor is `produce(its key)` (lazy_save), an object its own torch.save."""

    def __init__(self, layers: dict[str, list[str]], flat: dict[str, str], produce: Callable[[str], torch.Tensor]):
        super().__init__(lambda key: produce(flat[key]))
        self._layers, self._produce_layer, self._by_index = layers, produce, {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self._layers]
        for key, names in self._layers.items():
            full = self.state_dict[key]
            for i, name in enumerate(names):
                offsets = torch.Size([i] + [0] * (full.dim() - 1))
                self._by_index[(key, tuple(offsets))] = name
                items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(offsets, torch.Size([1, *full.shape[1:]])),
                                           properties=TensorProperties(dtype=full.dtype), size=full.shape)))
        self.plan = SavePlan(items, planner_data=plan.planner_data)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        name = self._by_index.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        if name is not None:
            full = self.state_dict[write_item.index.fqn]
            return as_planned(name, self._produce_layer(name), full.shape[1:], full.dtype).unsqueeze(0)
        found = self.lookup_object(write_item.index)
        if isinstance(found, _Pickled):  # the object's own torch.save, as Megatron-Core stores objects
            data = io.BytesIO()
            torch.save(found.value, data)
            return data
        return self.transform_object(write_item, found)


def write_mcore_checkpoint(save_dir: str, spec: dict[str, tuple[torch.Size, torch.dtype]],
                           produce: Callable[[str], torch.Tensor], *, args: dict, iteration: int) -> str:
    """Write our tensors `spec` (our names; `produce(name)` makes each, in its dtype) as a
    Megatron-Core torch_dist checkpoint of `save_dir` at `iteration`, with `args` (Megatron-LM's
    names) in its common state. Written aside and renamed; returns the iteration directory."""
    stacked: dict[str, list[tuple[int, str]]] = {}
    flat: dict[str, str] = {}
    for name in spec:
        key, layer = mcore_key(name)
        if layer is None:
            flat[key] = name
        else:
            stacked.setdefault(key, []).append((layer, name))
    state, layers = {}, {}
    for key, entries in stacked.items():
        entries.sort()
        if [i for i, _ in entries] != list(range(len(entries))):
            raise CheckpointError(f"{key}: layers {[i for i, _ in entries]} are not 0..{len(entries) - 1}")
        shape, dtype = spec[entries[0][1]]
        state[key] = torch.empty((len(entries), *shape), dtype=dtype, device="meta")
        layers[key] = [name for _, name in entries]
    for key, name in flat.items():
        shape, dtype = spec[name]
        state[key] = torch.empty(shape, dtype=dtype, device="meta")
    num_layers = len(next(iter(layers.values()))) if layers else 0
    for module in _EXTRA_STATE_MODULES:  # no extra state (fp8 metadata): as Megatron-Core writes it
        for i in range(num_layers):
            state[f"decoder.layers.{module}._extra_state/shard_{i}_{num_layers}"] = _pickled([None])
    state[COMMON] = _pickled([{"args": argparse.Namespace(**args), "checkpoint_version": 3.0,
                               "iteration": iteration}])
    final = os.path.join(save_dir, f"iter_{iteration:07d}")
    if os.path.exists(final):
        raise CheckpointError(f"{final} exists: not overwriting it")
    with publish.output_directory(save_dir):
        tmp = publish.temp_dir_for(final)
        os.makedirs(tmp)
        try:
            with this_process_alone():
                dcp.save(state, checkpoint_id=tmp, no_dist=True, planner=_StackedSavePlanner(layers, flat, produce))
            with open(os.path.join(tmp, "metadata.json"), "w") as f:
                json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
            tracker = os.path.join(save_dir, publish.TRACKER_FILENAME)  # Megatron-LM writes no newline
            publish.publish(tmp, final, then=lambda: publish.write_atomic(tracker, str(iteration).encode()))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


class _Pickled:
    """An object DCP writes as its own torch.save bytes (one opaque entry)."""

    def __init__(self, value):
        self.value = value


def _pickled(value) -> _Pickled:
    return _Pickled(value)
