"""Checkpoint tensors of partition-strided parameters in their full layout.

A parameter with Megatron's partition_stride s > 1 (a gated MLP's fc1: each
TP rank holds [gate_r; up_r]) is a DTensor whose global rows are the TP
ranks' parts laid end to end, which depend on the TP size
(tensor_parallel.partition_stride). A checkpoint stores its full layout
instead ([gate; up] for fc1: Megatron-Core's, the same at every TP size), so
that it reshards across TP sizes as any other tensor: each rank's rows are at
most s + 1 runs of consecutive full rows, which the planners below write and
read as chunks of their own. The same holds for the fp32 main params and the
optimizer state of such a parameter.

Checkpoints of format 3 and before stored a gated fc1 with its gate and up
rows interleaved (gate_0, up_0, gate_1, ...). `legacy_interleaved` reads a
run of gate (or up) rows from twice as many interleaved rows into a buffer,
and `finish` keeps every other row.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from .. import _torch_compat, parallel_state
from ..tensor_parallel import partition_stride


def strided_keys(model: nn.Module, state: dict) -> dict[str, int]:
    """{flattened DCP key: partition_stride} of the tensors of `state` (torch_dcp.sharded_state
    of `model`) that belong to strided parameters: weights, main params, optimizer state."""
    found = {}
    opt_state = state.get("optimizer", {}).get("state", {})
    for name, stride in partition_stride.strided_parameters(model).items():
        for section in ("model", "main_params"):
            if name in state.get(section, {}):
                found[f"{section}.{name}"] = stride
        rows = state["model"][name].shape if name in state.get("model", {}) else None
        for key, value in opt_state.get(name, {}).items():
            if isinstance(value, torch.Tensor) and rows is not None and value.shape == rows:
                found[f"optimizer.state.{name}.{key}"] = stride
    return found


@dataclasses.dataclass
class _Run:
    chunk: ChunkStorageMetadata  # rows of the stored tensor
    local: Optional[torch.Tensor] = None  # this rank's rows they are (a view of its shard)
    # Format 3: the rows read go into `buffer`, and (rows kept, this rank's rows) pairs take theirs.
    buffer: Optional[torch.Tensor] = None
    targets: list = dataclasses.field(default_factory=list)


def _runs(tensor: torch.Tensor, stride: int, legacy: bool) -> list[_Run]:
    """This rank's part of `tensor` as runs of the stored full tensor's rows."""
    if isinstance(tensor, DTensor) and tensor.device_mesh.get_coordinate() is None:
        return []  # not on this rank's mesh
    local = _torch_compat.local_tensor(tensor)
    (chunk,) = _torch_compat.create_chunk_list(tensor)
    size, rest_offsets, rest_sizes = tensor.shape[0], list(chunk.offsets[1:]), list(chunk.sizes[1:])
    tp = parallel_state.get_tensor_model_parallel_world_size()
    runs = {}
    for offset, first, rows in partition_stride.full_row_runs(int(chunk.offsets[0]), int(chunk.sizes[0]), size,
                                                              stride, tp):
        part = local.narrow(0, offset, rows)
        if not legacy:
            stored = ChunkStorageMetadata(torch.Size([first, *rest_offsets]), torch.Size([rows, *rest_sizes]))
            runs[first] = _Run(stored, local=part)
            continue
        # Stored interleaved: full row i of [gate; up] was stored row 2i (gate) or 2(i - F) + 1 (up).
        # A rank's gate and up rows of the same units read the same stored rows once.
        half = size // 2
        unit, parity = (first, 0) if first < half else (first - half, 1)
        runs.setdefault(unit, []).append((parity, part))
    if not legacy:
        return list(runs.values())
    found = []
    for unit, parts in runs.items():
        rows = max(part.shape[0] for _, part in parts)
        stored = ChunkStorageMetadata(torch.Size([2 * unit, *rest_offsets]), torch.Size([2 * rows, *rest_sizes]))
        buffer = local.new_empty((2 * rows, *local.shape[1:]))
        found.append(_Run(stored, buffer=buffer, targets=[(slice(parity, 2 * part.shape[0], 2), part)
                                                          for parity, part in parts]))
    return found


class StridedSavePlanner(DefaultSavePlanner):
    """DCP's save planner, writing the tensors of `strided` ({key: stride}) in their full layout."""

    def __init__(self, strided: dict[str, int]):
        super().__init__()
        self._strided = strided
        self._data: dict[tuple, torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [item for item in plan.items if item.index.fqn not in self._strided]
        for key, stride in self._strided.items():
            tensor = self.state_dict[key]
            for run in _runs(tensor, stride, legacy=False):
                index = MetadataIndex(key, run.chunk.offsets)
                self._data[(key, tuple(run.chunk.offsets))] = run.local
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk=run.chunk, properties=TensorProperties.create_from_tensor(run.local),
                    size=tensor.size())))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        data = self._data.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        return data if data is not None else super().resolve_data(write_item)


class StridedReads:
    """The read side, for a load planner: `items(metadata)` plans the reads of the tensors
    of `strided` ({key: stride}) of `state_dict`, `lookup(index)` gives the tensor a read
    goes into, `finish()` (after the load) keeps a format-3 checkpoint's rows."""

    def __init__(self, state_dict: dict, strided: dict[str, int], legacy_interleaved: bool):
        self._runs = {key: _runs(state_dict[key], stride, legacy_interleaved) for key, stride in strided.items()}
        self._by_index = {(key, tuple(run.chunk.offsets)): run for key, runs in self._runs.items() for run in runs}

    def items(self, metadata) -> list:
        found = []
        for key, runs in self._runs.items():
            found += create_read_items_for_chunk_list(key, metadata.state_dict_metadata[key],
                                                      [run.chunk for run in runs])
        return found

    def lookup(self, index: MetadataIndex) -> Optional[torch.Tensor]:
        run = self._by_index.get((index.fqn, tuple(index.offset or ())))
        if run is None:
            return None
        return run.buffer if run.buffer is not None else run.local

    @torch.no_grad()
    def finish(self) -> None:
        for run in self._by_index.values():
            for keep, local in run.targets:
                local.copy_(run.buffer[keep])
