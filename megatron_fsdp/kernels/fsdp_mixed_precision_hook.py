"""The one hook deeper in FSDP2: fuse the mixed-precision cast into copy-in.

Under a MixedPrecisionPolicy FSDP2 first casts every fp32 shard into a
param_dtype temporary (`_get_param_all_gather_inputs`), then copies the
temporary into the all-gather buffer (`fsdp::all_gather_copy_in`): two passes
over the bytes. With this hook the fp32 shards go to the copy-in as they are,
marked with the dtype they are to be gathered in, and `all_gather_copy_in`
casts while it copies (ours in one pass; torch's `_foreach_copy_` casts too,
so results are the same either way, bitwise).

It replaces two module-level functions of
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, which FSDP2 looks
up at call time. `supported()` checks that they exist with the signatures
this code was written against (megatron_fsdp/_torch_compat.py names them and
the FSDP2 state read here); tests assert it for the torch in CI, so a torch
that changes them fails loudly instead of silently running unfused.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from .. import _torch_compat

_CAST_ATTR = "_megatron_fsdp_gather_dtype"
_originals: Optional[dict] = None


def supported() -> bool:
    try:
        module = _torch_compat.fsdp_collectives_module()
    except ImportError:
        return False
    for name, params in _torch_compat.ALL_GATHER_INPUT_FUNCTIONS.items():
        fn = getattr(module, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != params:
            return False
    return True


def _param_all_gather_inputs(fsdp_params):
    if _torch_compat.compiled_autograd_enabled() or not all(_torch_compat.casts_in_copy_in(p) for p in fsdp_params):
        # A group mixing in extension (e.g. fp8) or offloaded parameters keeps
        # torch's path: its byte-level packing assumes already-cast inputs.
        # So does compiled autograd on torch 2.11, which gathers differently.
        return _originals["_get_param_all_gather_inputs"](fsdp_params)
    inputs = []
    for fsdp_param in fsdp_params:
        data = _torch_compat.all_gather_source(fsdp_param)
        marked = data.view(data.shape)  # a fresh view to carry the mark, not the shard itself
        setattr(marked, _CAST_ATTR, fsdp_param.param_dtype)
        inputs.append([marked])
    return inputs


def _all_gather_input_metadatas(param_all_gather_inputs):
    dtypes, numels = [], []
    gather_dtype = getattr(param_all_gather_inputs[0][0], _CAST_ATTR, param_all_gather_inputs[0][0].dtype)
    for inputs in param_all_gather_inputs:
        input_dtypes = [getattr(t, _CAST_ATTR, t.dtype) for t in inputs]
        if any(d != gather_dtype for d in input_dtypes):
            gather_dtype = torch.uint8
        dtypes.append(input_dtypes)
        numels.append([t.numel() for t in inputs])
    return dtypes, numels, gather_dtype


def install() -> bool:
    """Fuse the cast into copy-in; returns False (changing nothing) on an unsupported torch."""
    global _originals
    if _originals is not None:
        return True
    if not supported():
        return False
    _originals = _torch_compat.replace_all_gather_input_functions({
        "_get_param_all_gather_inputs": _param_all_gather_inputs,
        "_get_all_gather_input_metadatas": _all_gather_input_metadatas,
    })
    return True


def uninstall() -> None:
    global _originals
    if _originals is None:
        return
    _torch_compat.replace_all_gather_input_functions(_originals)
    _originals = None


def installed() -> bool:
    return _originals is not None
