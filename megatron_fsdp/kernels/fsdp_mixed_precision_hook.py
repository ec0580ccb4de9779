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
this code was written against (torch 2.9-2.14); tests assert it for the
torch in CI, so a torch that changes them fails loudly instead of silently
running unfused.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

_CAST_ATTR = "_megatron_fsdp_gather_dtype"
_EXPECTED_PARAMETERS = {
    "_get_param_all_gather_inputs": ["fsdp_params"],
    "_get_all_gather_input_metadatas": ["param_all_gather_inputs"],
}
_originals: Optional[dict] = None


def _collectives():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


def supported() -> bool:
    try:
        module = _collectives()
        from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState  # noqa: F401
    except ImportError:
        return False
    for name, params in _EXPECTED_PARAMETERS.items():
        fn = getattr(module, name, None)
        if fn is None or list(inspect.signature(fn).parameters) != params:
            return False
    return True


def _fusable(fsdp_param) -> bool:
    # FSDP2's own fast-path condition for casting shards (see _get_param_all_gather_inputs).
    return (fsdp_param.param_dtype is not None and not fsdp_param.offload_to_cpu
            and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"))


def _param_all_gather_inputs(fsdp_params):
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if not all(_fusable(p) for p in fsdp_params):
        # A group mixing in extension (e.g. fp8) or offloaded parameters keeps
        # torch's path: its byte-level packing assumes already-cast inputs.
        return _originals["_get_param_all_gather_inputs"](fsdp_params)
    inputs = []
    for fsdp_param in fsdp_params:
        data = (fsdp_param._sharded_param_data if fsdp_param.sharded_state == ShardedState.SHARDED
                else fsdp_param._sharded_post_forward_param_data)
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
    module = _collectives()
    _originals = {name: getattr(module, name) for name in _EXPECTED_PARAMETERS}
    module._get_param_all_gather_inputs = _param_all_gather_inputs
    module._get_all_gather_input_metadatas = _all_gather_input_metadatas
    return True


def uninstall() -> None:
    global _originals
    if _originals is None:
        return
    module = _collectives()
    for name, fn in _originals.items():
        setattr(module, name, fn)
    _originals = None


def installed() -> bool:
    return _originals is not None
