"""Loading vocabulary rows across a different padding.

Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by`
x TP, so the embedding and output-layer rows change with TP: a vocabulary of
128 is 256 rows at TP=2 and 128 at TP=1. The checkpoint records the true
vocabulary size; on load the rows below it are read from the checkpoint
whatever either side's padding, and the rows past it (padding) are
zero-filled, in the weights, fp32 main params and optimizer state alike.
Only a different true vocabulary is an error.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from .. import _torch_compat
from .core import EXTRA_STATE_SUFFIX, CheckpointError


def vocab_param_names(model: nn.Module) -> list[str]:
    """Parameters whose rows are the (padded) vocabulary: embedding tables and an untied output layer."""
    from ..tensor_parallel.layers import VocabParallelEmbedding

    names = [f"{name}.weight".lstrip(".") for name, m in model.named_modules()
             if isinstance(m, VocabParallelEmbedding)]
    output = getattr(model, "output_layer", None)
    if hasattr(model, "vocab_size") and getattr(output, "weight", None) is not None:
        names.append("output_layer.weight")
    return names


def vocab_row_tensors(state: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors of `state` (model, main params, optimizer state) with
    vocabulary rows, by their flattened DCP key."""
    found = {}
    opt_state = state.get("optimizer", {}).get("state", {})
    for name in names:
        for section in ("model", "main_params"):
            if name in state.get(section, {}):
                found[f"{section}.{name}"] = state[section][name]
        rows = state["model"][name].shape[0] if name in state.get("model", {}) else None
        for key, value in opt_state.get(name, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
                found[f"optimizer.state.{name}.{key}"] = value
    return found


def plan_rows(path: str, saved: dict, state: dict, names: list[str], saved_vocab: Optional[int],
              true_vocab_size: Optional[int]) -> dict[str, int]:
    """Check the checkpoint's shapes against the model's before reading any
    data. Returns {DCP key: rows to read} for the tensors whose padded row
    counts differ; raises CheckpointError listing every misfit."""
    if saved_vocab is not None and true_vocab_size is not None and saved_vocab != true_vocab_size:
        raise CheckpointError(f"checkpoint {path} was saved with a vocabulary of {saved_vocab} tokens, the model "
                              f"has {true_vocab_size}: a different vocabulary cannot be loaded")
    both_known = saved_vocab is not None and true_vocab_size is not None
    rowed = vocab_row_tensors(state, names)
    checked = {f"model.{k}": v for k, v in state["model"].items()}
    checked.update(rowed)
    problems, rows = [], {}
    for key, value in checked.items():
        shown = key[len("model."):] if key.startswith("model.") else key
        md = saved.get(key)
        if md is None:
            problems.append(f"{shown}: missing from the checkpoint")
            continue
        if not isinstance(value, torch.Tensor) or not isinstance(md, TensorStorageMetadata):
            continue
        want, have = tuple(value.shape), tuple(md.size)  # DTensor: the global shape
        if want == have:
            continue
        if (key in rowed and both_known and want[1:] == have[1:]
                and min(want[0], have[0]) >= true_vocab_size):
            rows[key] = true_vocab_size
            continue
        problem = f"{shown}: checkpoint has shape {list(have)}, model has {list(want)}"
        if key in rowed and want[1:] == have[1:] and not both_known:
            if saved_vocab is None and true_vocab_size is None:
                problem += (" (another vocabulary padding: pass true_vocab_size= to save_checkpoint and "
                            "load_checkpoint to load across it)")
            elif true_vocab_size is None:
                problem += (f" (another vocabulary padding: pass true_vocab_size= to load_checkpoint; the "
                            f"checkpoint's is {saved_vocab})")
            else:
                problem += " (another vocabulary padding, and the checkpoint does not record its true vocabulary)"
        elif key in rowed and both_known and want[1:] == have[1:]:
            problem += f" (fewer rows than the true vocabulary of {true_vocab_size})"
        problems.append(problem)
    # Module extra state the model does not keep (an fp8 run's scaling histories
    # loaded without fp8) is left unread; any other tensor must find its place.
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k not in checked
                   and not k.endswith(EXTRA_STATE_SUFFIX))
    problems += [f"{k}: in the checkpoint but not in the model" for k in extra]
    if problems:
        shown = "\n  ".join(problems[:10]) + ("\n  ..." if len(problems) > 10 else "")
        raise CheckpointError(f"checkpoint {path} does not fit the model:\n  {shown}")
    return rows


@torch.no_grad()
def zero_fill(state: dict, names: list[str], rows: dict[str, int]) -> None:
    """Zero the local shards of the tensors read partially: the rows past
    the true vocabulary are then zero, whatever their initial values."""
    for key, tensor in vocab_row_tensors(state, names).items():
        if key in rows:
            (tensor.to_local() if isinstance(tensor, DTensor) else tensor).zero_()


def partial_row_reads(state_dict: dict, rows: dict[str, int], metadata) -> list:
    """DCP read items for the first `rows[key]` rows of the listed tensors of the
    (flattened) `state_dict`: the checkpoint's rows and the model's share the same
    indices below the true vocabulary, whatever the two paddings."""
    items = []
    for key, count in rows.items():
        tensor = state_dict[key]
        if isinstance(tensor, DTensor) and tensor.device_mesh.get_coordinate() is None:
            continue
        chunks = []
        for chunk in _torch_compat.create_chunk_list(tensor):
            keep = min(chunk.sizes[0], max(0, count - chunk.offsets[0]))
            if keep > 0:
                # Same origin as the local shard: the read items' offsets stay valid in it.
                chunks.append(ChunkStorageMetadata(offsets=chunk.offsets,
                                                   sizes=torch.Size([keep, *chunk.sizes[1:]])))
        items += create_read_items_for_chunk_list(key, metadata.state_dict_metadata[key], chunks)
    return items
