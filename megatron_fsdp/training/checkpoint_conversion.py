"""Checkpoint conversion between Hugging Face model directories, Megatron-Core's
torch_dist checkpoints and ours (tools/checkpoint/convert.py, Megatron-LM's tool
name and flags).

A loader opens its source and describes the model as megatron_fsdp's GPT
sees it at TP=1: the pretraining flags (destination names), the true
vocabulary size, and each full tensor's name, shape and dtype, with a
function that reads or makes one tensor when asked. A saver writes that
description in its format, asking for one tensor at a time (the HF saver:
one shard at a time), so a model never needs its full size in memory.
Nothing is written into the target until everything is: both savers write
aside and rename.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from typing import Callable, Optional

import torch

from ..dist_checkpointing import hf as hf_mapping
from ..dist_checkpointing.core import CheckpointError
from ..dist_checkpointing.hf_directory import HFDirectory, write_hf_directory
from ..dist_checkpointing.mcore import McoreReader, write_mcore_checkpoint
from .checkpointing import ARCHITECTURE_ARGS, RUN_DEFAULT_ARGS
from .offline_checkpoint import CheckpointReader, write_checkpoint

Spec = dict[str, tuple[torch.Size, torch.dtype]]


@dataclasses.dataclass
class Model:
    """A model to convert: flags, vocabulary, and its tensors under megatron_fsdp's names."""
    args: dict
    true_vocab_size: int
    spec: Spec
    get: Callable[[str], torch.Tensor]


class _Cached:
    """`read(name)` with the last few tensors kept: one source tensor feeds several outputs
    (the fused QKV makes q, k and v; fc1 makes gate and up)."""

    def __init__(self, read: Callable[[str], torch.Tensor], keep: int = 4):
        self._read, self._keep, self._kept = read, keep, collections.OrderedDict()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._kept:
            self._kept[name] = self._read(name)
            while len(self._kept) > self._keep:
                self._kept.popitem(last=False)
        return self._kept[name]


def _through(recipe: hf_mapping.Recipe, spec: Spec, get: Callable[[str], torch.Tensor]) -> tuple[Spec, Callable]:
    """A recipe applied to a lazily read source: the outputs' spec (the recipe run on meta
    tensors) and a function making one output."""
    missing = sorted({n for inputs, _ in recipe.values() for n in inputs if n not in spec})
    if missing:
        raise CheckpointError(f"the source lacks {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))
    out = {}
    for name, (inputs, fn) in recipe.items():
        made = fn(*(torch.empty(spec[n][0], dtype=spec[n][1], device="meta") for n in inputs))
        out[name] = (made.shape, made.dtype)
    cached = _Cached(get)
    return out, lambda name: recipe[name][1](*map(cached, recipe[name][0]))


def _check_shapes(where: str, spec: Spec, expected: dict[str, tuple]) -> None:
    wrong = [f"{name}: {list(spec[name][0])}, the config says {list(shape)}"
             for name, shape in expected.items() if name in spec and tuple(spec[name][0]) != tuple(shape)]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise CheckpointError(f"{where}: tensors disagree with config.json: " + "; ".join(wrong[:3]) + more)


def load_hf(path: str, make_vocab_size_divisible_by: int = 128) -> Model:
    """A Hugging Face Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE or Qwen3-MoE directory. The
    vocabulary is padded as Megatron-LM pads it at TP=1 (a load at another TP size reads across
    the padding)."""
    directory = HFDirectory(path)
    hf = directory.config
    hf_mapping.check_hf_config(hf)
    vocab = hf["vocab_size"]
    padded = math.ceil(vocab / make_vocab_size_divisible_by) * make_vocab_size_divisible_by
    source = {name: (directory.shape(name), directory.dtype(name)) for name in directory.names()}
    _check_shapes(path, source, hf_mapping.expected_shapes(hf))
    spec, get = _through(hf_mapping.hf_to_megatron_fsdp_recipe(hf, padded), source, directory.tensor)
    return Model(hf_mapping.model_args(hf), vocab, spec, get)


def load_megatron_fsdp(path: str, iteration: Optional[int] = None, verify: bool = True) -> Model:
    """One of our checkpoint directories (the tracker's iteration, or `iteration`), saved at
    any TP x DP layout: each tensor is read whole, as its full value."""
    reader = CheckpointReader(path, iteration, verify=verify)
    if not reader.args:
        raise CheckpointError(f"checkpoint {reader.path} stores no model flags (it was not saved by pretrain() "
                              "or this tool): its architecture is unknown")
    spec = {name: (reader.shape(name), reader.dtype(name)) for name in reader.names()}
    vocab = reader.true_vocab_size or int(spec["embedding.word_embeddings.weight"][0][0])
    return Model(dict(reader.args), vocab, spec, reader.tensor)


_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def load_mcore(path: str, iteration: Optional[int] = None, true_vocab_size: Optional[int] = None) -> Model:
    """A Megatron-Core torch_dist checkpoint (dist_checkpointing/mcore.py): model weights, each
    layer's tensor read alone from its stacked tensor; the flags from its stored `args`."""
    reader = McoreReader(path, iteration)
    # Megatron-LM's names of the architecture flags are ours.
    args = {k: reader.args[k] for k in ARCHITECTURE_ARGS + RUN_DEFAULT_ARGS if k in reader.args
            if reader.args.get("num_experts") or not k.startswith("moe_")}  # a dense model's MoE defaults: noise
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if k not in args]
    if missing:
        raise CheckpointError(f"{reader.path}: its stored args lack {', '.join(missing)}: its architecture is unknown")
    _refuse_mcore_experts(args, f"{reader.path}: --loader mcore")
    layers = reader.layers()
    names = [n for n in ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight")]
    for i in range(layers):
        for rest in ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
                     "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                     "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                     "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"):
            names.append(f"decoder.layers.{i}.{rest}")
    spec = {}
    for name in names:
        try:
            spec[name] = (reader.shape(name), reader.dtype(name))
        except CheckpointError:
            if name.endswith((".bias", "output_layer.weight")):
                continue  # a model without biases, with tied embeddings
            raise
    rows = int(spec["embedding.word_embeddings.weight"][0][0])
    vocab = true_vocab_size or reader.args.get("vocab_size") or rows
    return Model(args, int(vocab), spec, reader.tensor)


def _refuse_mcore_experts(args: dict, where: str) -> None:
    # NOTE: Megatron-Core's expert tensors (per-expert shards on an expert axis, dense and MoE
    # layers sharing one stacked layer axis, its GroupedMLP's own layout) are not mapped here:
    # without a checkpoint megatron-core wrote to test against, they would be a guess.
    if args.get("num_experts"):
        raise CheckpointError(f"{where}: mixture-of-experts models (--num-experts {args['num_experts']}) are not "
                              "converted to or from Megatron-Core checkpoints")


def save_mcore(model: Model, save_dir: str, *, dtype: Optional[torch.dtype] = None, target_tensor_parallel_size: int = 1,
               make_vocab_size_divisible_by: int = 128, iteration: int = 0) -> str:
    """Write a Megatron-Core torch_dist checkpoint (weights; the flags as its stored `args`), the
    vocabulary padded as Megatron-LM pads it for `target_tensor_parallel_size`."""
    _refuse_mcore_experts(model.args, "--saver mcore")
    multiple = make_vocab_size_divisible_by * target_tensor_parallel_size
    padded = math.ceil(model.true_vocab_size / multiple) * multiple
    spec = dict(_dtype_of(model.spec, dtype))
    for name in _VOCAB_ROWS:
        if name in spec:
            spec[name] = (torch.Size([padded, *spec[name][0][1:]]), spec[name][1])

    def produce(name):
        t = model.get(name).to(spec[name][1])
        if name in _VOCAB_ROWS:
            t = hf_mapping.pad_rows(t[:model.true_vocab_size], padded)
        return t

    args = dict(model.args, padded_vocab_size=padded, vocab_size=model.true_vocab_size,
                tensor_model_parallel_size=target_tensor_parallel_size, pipeline_model_parallel_size=1,
                make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    return write_mcore_checkpoint(save_dir, spec, produce, args=args, iteration=iteration)


def _dtype_of(spec: Spec, dtype: Optional[torch.dtype]) -> Spec:
    return {name: (shape, dtype or own) for name, (shape, own) in spec.items()}


def save_hf(model: Model, save_dir: str, *, dtype: Optional[torch.dtype] = None,
            max_shard_bytes: int = 5 * 2 ** 30, tokenizer_model: Optional[str] = None) -> dict:
    """Write a Hugging Face directory (config.json, safetensors, tokenizer files); returns config.json."""
    weights = {shape_dtype[1] for shape_dtype in model.spec.values()}
    config = hf_mapping.hf_config(model.args, model.true_vocab_size, dtype or max(weights, key=_width))
    spec, get = _through(hf_mapping.megatron_fsdp_to_hf_recipe(config), model.spec, model.get)
    write_hf_directory(save_dir, config, _dtype_of(spec, dtype), get, max_shard_bytes=max_shard_bytes,
                       extra_files=tokenizer_files(tokenizer_model))
    return config


def _width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tokenizer_files(tokenizer_model: Optional[str]) -> tuple[str, ...]:
    """The tokenizer files to copy: a tokenizer.json, or those of a tokenizer folder."""
    if tokenizer_model is None:
        return ()
    if os.path.isfile(tokenizer_model):
        if os.path.basename(tokenizer_model) != "tokenizer.json":
            raise CheckpointError(f"--tokenizer-model {tokenizer_model}: expected a tokenizer.json or its folder")
        return (tokenizer_model,)
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    found = tuple(os.path.join(tokenizer_model, n) for n in names if os.path.isfile(os.path.join(tokenizer_model, n)))
    if not found:
        raise CheckpointError(f"--tokenizer-model {tokenizer_model}: no tokenizer.json there")
    return found


def save_megatron_fsdp(model: Model, save_dir: str, *, dtype: Optional[torch.dtype] = None,
                       source: str = "hf") -> str:
    """Write one of our checkpoints (iteration 0, weights and model flags only: load it with
    --finetune, or --no-load-optim); returns its path."""
    return write_checkpoint(save_dir, _dtype_of(model.spec, dtype), model.get, args=model.args,
                            true_vocab_size=model.true_vocab_size, source=source)


def model_flags(args: dict) -> str:
    """The pretraining flags of `args` as a command line (what --use-checkpoint-args reads)."""
    words = []
    for name, value in args.items():
        if name == "rope_scaling_factor" and not args.get("use_rope_scaling"):
            continue  # stored as the flag's value, meaningless without --use-rope-scaling
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words += [flag] if value else []
        elif isinstance(value, (list, tuple)):
            words += [flag, "[" + ",".join(map(str, value)) + "]"]  # one word, as --moe-layer-freq reads it
        elif value is not None:
            words += [flag, str(value)]
    return " ".join(words)
