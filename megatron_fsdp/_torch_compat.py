"""Everything megatron_fsdp takes from torch beyond its public API, in one place.

Supported torch: 2.11 up to (not including) 2.15 (`SUPPORTED_TORCH`). Public API
is used wherever torch has one (`FSDPModule.set_requires_gradient_sync`,
`DTensor.to_local`, ...); what follows has none, so each function says which
private name it relies on and how the supported versions differ.
`PRIVATE_NAMES` lists every one of them, and tests/test_torch_compat.py pins
them on the running torch (and checks that no other module of the package
reaches into torch's private names), so a torch that renames one fails there,
by name, instead of in a user's job.

Differences handled here (read from each version's sources):
- FSDP2's per-module state holds one `_fsdp_param_group` (or None) in torch
  2.11; from 2.12 it holds a list `_fsdp_param_groups` (and
  `_fsdp_param_group` becomes a property that raises when there are several).
- torch 2.11's `_get_param_all_gather_inputs` returns each parameter's own
  `all_gather_inputs` under compiled autograd; 2.12 dropped that branch. The
  mixed-precision hook (kernels/fsdp_mixed_precision_hook.py) defers to torch
  there on every version.
"""

from __future__ import annotations

import datetime
import functools
import warnings
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

SUPPORTED_TORCH = ((2, 11), (2, 15))  # [lowest, first unsupported): major.minor

# Every private name used, as "module:attribute path", with the torch versions
# that have it ([first, first without), None: every supported version).
# Objects that exist only at run time (FSDP2's per-module state and
# parameters) are in FSDP_PRIVATE_ATTRIBUTES, checked on a live fully_shard
# module by the tests.
ALL = None
PRIVATE_NAMES = {
    "torch.distributed.distributed_c10d:_get_default_group": ALL,
    "torch.distributed.distributed_c10d:_get_default_store": ALL,
    "torch.distributed.distributed_c10d:_set_pg_timeout": ALL,
    "torch.distributed:ProcessGroup._get_backend": ALL,
    "torch.distributed._functional_collectives:all_reduce": ALL,
    "torch.distributed._functional_collectives:all_gather_tensor": ALL,
    "torch.distributed._functional_collectives:reduce_scatter_tensor": ALL,
    "torch.distributed.device_mesh:DeviceMesh._flatten": ALL,
    "torch.distributed.fsdp:FSDPModule._get_fsdp_state": ALL,
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_param_all_gather_inputs": ALL,
    "torch.distributed.fsdp._fully_shard._fsdp_collectives:_get_all_gather_input_metadatas": ALL,
    "torch.distributed.fsdp._fully_shard._fsdp_common:compiled_autograd_enabled": ((2, 11), (2, 12)),
    "torch.distributed.fsdp._fully_shard._fsdp_param:ShardedState.SHARDED": ALL,
    "torch.distributed.checkpoint.planner_helpers:_create_chunk_list": ALL,
    "torch.distributed.checkpoint.state_dict:_EXTRA_STATE": ALL,
    "torch.distributed.checkpoint._traverse:set_element": ALL,
    "torch.distributed.checkpoint.filesystem:FileSystemReader._get_metadata_path": ALL,
    "torch.distributed.tensor.debug:_clear_sharding_prop_cache": ALL,
    "torch.distributed.tensor._redistribute:clear_redistribute_planner_cache": ALL,
    "torch.distributed.tensor._redistribute:_gen_transform_infos.cache_clear": ALL,
    "torch.distributed.tensor._collective_utils:MeshTopoInfo.build_from_mesh.cache_clear": ALL,
    "torch:Tensor._make_wrapper_subclass": ALL,
    "torch:Tensor._version": ALL,
    "torch.nn:MultiheadAttention._reset_parameters": ALL,
    "torch._C:_disabled_torch_function_impl": ALL,
    "torch.utils._pytree:tree_map_only": ALL,
    "torch.utils._pytree:tree_leaves": ALL,
    "torch:_scaled_mm": ALL,
    "torch:_grouped_mm": ALL,
    "torch:_foreach_norm": ALL,
    "torch:_foreach_mul_": ALL,
    "torch:_amp_foreach_non_finite_check_and_unscale_": ALL,
    "torch._C:_cuda_getArchFlags": ALL,
    "torch.cuda.memory:_record_memory_history": ALL,
    "torch.cuda.memory:_snapshot": ALL,
    "torch._C._distributed_c10d:_dump_fr_trace": ALL,
    "torch._C._distributed_c10d:_dump_nccl_trace": ALL,
}
# Absent from CPU builds of torch: cuda_arch_flags, and NCCL's Flight Recorder (flight_recorder_trace).
CUDA_BUILD_ONLY = {"torch._C:_cuda_getArchFlags", "torch._C._distributed_c10d:_dump_nccl_trace"}

# On DTensors, DeviceMeshes, FSDP2's FSDPParam (per parameter) and its module state; read at run time.
FSDP_PRIVATE_ATTRIBUTES = {
    "dtensor": ("_local_tensor",),
    "state": ("_fsdp_param_groups (torch >= 2.12) or _fsdp_param_group (torch 2.11)",),
    "param_group": ("fsdp_params",),
    "mesh": ("_pg_registry",),  # where this torch has it (drop_mesh_process_groups)
    "param": ("unsharded_accumulated_grad", "_unsharded_param", "_sharded_local_tensor", "_sharded_param_data",
              "_sharded_post_forward_param_data", "sharded_state", "param_dtype", "offload_to_cpu"),
}

# The schemas of FSDP2's copy ops that our kernels implement, as torch 2.9-2.14
# declare them (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
FSDP_COPY_OP_SCHEMAS = {
    "all_gather_copy_in": "fsdp::all_gather_copy_in(Tensor[] all_gather_inputs, Tensor all_gather_output, "
                          "SymInt[] inp_split_sizes, SymInt all_gather_input_numel, SymInt rank) -> (Tensor, Tensor)",
    "split_with_sizes_copy": "fsdp::split_with_sizes_copy(Tensor all_gather_output, SymInt[] "
                             "all_gather_input_split_sizes, int dim=0, *, Tensor(a!)[] out) -> ()",
    "chunk_cat": "fsdp::chunk_cat(Tensor[] tensors, int dim, int num_chunks, *, Tensor(a!) out) -> ()",
}

# The signatures of the FSDP2 functions the mixed-precision hook replaces.
ALL_GATHER_INPUT_FUNCTIONS = {
    "_get_param_all_gather_inputs": ["fsdp_params"],
    "_get_all_gather_input_metadatas": ["param_all_gather_inputs"],
}


# ------------------------------------------------------------------ versions

def torch_version(version: Optional[str] = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: the running torch), ignoring local tags."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def torch_is_supported(version: Optional[str] = None) -> bool:
    low, high = SUPPORTED_TORCH
    return low <= torch_version(version) < high


def supported_torch_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    return f"torch >= {lo_major}.{lo_minor}, < {hi_major}.{hi_minor}"


_warned_version = False


def warn_if_unsupported_torch() -> None:
    """One warning per process on a torch outside SUPPORTED_TORCH (it may work; it is not tested)."""
    global _warned_version
    if _warned_version or torch_is_supported():
        return
    _warned_version = True
    warnings.warn(f"megatron_fsdp supports {supported_torch_range()}; torch {torch.__version__} is not tested "
                  "and may differ in the private FSDP2 state megatron_fsdp/_torch_compat.py relies on",
                  RuntimeWarning, stacklevel=2)


# ------------------------------------------------------------------ compiler

# NOTE: the attribute torch.compiler.assume_constant_result sets (its whole body in torch/_dynamo/
# decorators.py, 2.11-2.14), pinned against the real decorator by tests/test_torch_compat.py.
DYNAMO_CONSTANT_RESULT_ATTRIBUTE = "_dynamo_marked_constant"


def assume_constant_result(fn):
    """torch.compiler.assume_constant_result(fn) without importing torch._dynamo: the public
    decorator imports the whole compiler (about 0.6 s per process) to set one attribute on `fn`,
    and a module-level use made every rank of every job pay that at import."""
    setattr(fn, DYNAMO_CONSTANT_RESULT_ATTRIBUTE, True)
    return fn


# ------------------------------------------------------------------ c10d

def default_group() -> dist.ProcessGroup:
    """The default (world) process group: `distributed_c10d._get_default_group`."""
    return dist.distributed_c10d._get_default_group()


def default_store() -> Optional[dist.Store]:
    """The rendezvous key-value store of the default group, or None where this
    torch does not expose it (`distributed_c10d._get_default_store`)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def set_group_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Change an existing group's collective timeout (`distributed_c10d._set_pg_timeout`);
    public API sets it only when a group is created."""
    dist.distributed_c10d._set_pg_timeout(timeout, group)


def group_timeout(group: dist.ProcessGroup) -> Optional[datetime.timedelta]:
    """The collective timeout `group` was made with (its backend's options, `ProcessGroup._get_backend`),
    or None where it cannot be read: public API has no getter."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def traced_collective(kind: str, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A collective over `group` as torch.compile must trace it, through torch's functional
    collectives (`distributed._functional_collectives`): "all_reduce" (sum), or "all_gather" or
    "reduce_scatter" (sum) along dimension 0 of a contiguous `x`. torch 2.11 traced the in-place c10d collectives inside
    an autograd.Function's forward or backward so that the gradient through it came out zero
    (tests/test_tensor_parallel_layers.py compares compiled with eager mappings)."""
    import torch.distributed._functional_collectives as funcol

    if kind == "all_reduce":
        return funcol.all_reduce(x, "sum", group)
    if kind == "all_gather":
        return funcol.all_gather_tensor(x, 0, group)
    if kind == "reduce_scatter":
        return funcol.reduce_scatter_tensor(x, "sum", 0, group)
    raise ValueError(f"traced_collective: kind must be all_reduce, all_gather or reduce_scatter, got {kind!r}")


# ------------------------------------------------------------------ DeviceMesh and DTensor

def flatten_mesh(mesh, name: str):
    """One 1-D mesh over all dims of `mesh` (a slice of a root mesh), registered
    under `name` in the root (`DeviceMesh._flatten`; same signature 2.11-2.14)."""
    return mesh._flatten(name)


def drop_mesh_process_groups(mesh) -> None:
    """Make a mesh of a destroyed default group let go of its process groups.

    `DeviceMesh._pg_registry` (a dict on the root mesh, for every group of it
    and its views; torch.compile's lookups only): DTensor's caches keep meshes
    (sharding specs, redistribution plans, topology) for the rest of the
    process, and through that dict every group of the mesh, each with its
    threads and sockets (tests/test_parallel_state.py checks that a finished
    job leaves none alive). On a torch without the dict there is nothing to drop."""
    registry = getattr(mesh, "_pg_registry", None)
    if registry is not None:
        registry.clear()


def clear_dtensor_sharding_caches() -> None:
    """`tensor.debug._clear_sharding_prop_cache`, the redistribution planners and
    transform plans of `tensor._redistribute`, and `MeshTopoInfo`'s per-mesh
    topology. DTensor caches these by specs and meshes, and DeviceMesh equality
    ignores process groups: after a new default group (destroy and init again in
    one process) a cache hit hands back a spec whose mesh holds the destroyed
    world's groups ("Could not resolve the process group registered under the
    name N"), and until cleared they keep a user's mesh alive, with its groups
    and their threads (tests/test_parallel_state.py checks both)."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor object itself (`DTensor._local_tensor`); any other
    tensor as it is. Not `to_local()`: from torch 2.13, for a Parameter wrapping a
    DTensor it returns a fresh view even outside autograd, and the fp8 weight
    subclasses must update the very object FSDP2 holds."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


# ------------------------------------------------------------------ FSDP2 state

def fsdp_param_groups(module) -> list:
    """The FSDPParamGroups of one `fully_shard`-ed module (empty when it owns no
    parameters): `FSDPModule._get_fsdp_state()` then `_fsdp_param_groups`
    (torch >= 2.12) or `_fsdp_param_group` (2.11)."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):  # 2.12+: a list (the singular name is a raising property)
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def fsdp_params(root: nn.Module) -> Iterator:
    """Every FSDPParam of every `fully_shard`-ed module in `root` (root included)."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            for group in fsdp_param_groups(module):
                yield from group.fsdp_params


def unsharded_grads(fsdp_param) -> list[torch.Tensor]:
    """The unsharded gradients FSDP2 holds for a parameter between backward and
    reduce-scatter: `unsharded_accumulated_grad` (mixed precision accumulates
    upcast there) and the unsharded parameter's `.grad` (`_unsharded_param`)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)  # absent before the first all-gather
    grads = (fsdp_param.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad)
    return [g for g in grads if g is not None]


def drop_unsharded_grads(fsdp_param) -> None:
    fsdp_param.unsharded_accumulated_grad = None
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    if unsharded is not None:
        unsharded.grad = None


def fsdp_collectives_module():
    """torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: it registers the
    `fsdp::` copy ops when imported and holds the functions the
    mixed-precision hook replaces (looked up there at call time)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


def fsdp_copy_op_schema(name: str) -> str:
    """The running torch's schema of `fsdp::<name>`, or '<missing: ...>'."""
    try:
        fsdp_collectives_module()
        return str(getattr(torch.ops.fsdp, name).default._schema)
    except (AttributeError, ImportError, RuntimeError) as exc:
        return f"<missing: {exc}>"


def replace_all_gather_input_functions(functions: dict) -> dict:
    """Put `functions` (names from ALL_GATHER_INPUT_FUNCTIONS) in place of FSDP2's own
    in _fsdp_collectives, which looks them up at call time; returns the previous ones."""
    unknown = set(functions) - set(ALL_GATHER_INPUT_FUNCTIONS)
    if unknown:
        raise ValueError(f"not FSDP2 all-gather input functions: {sorted(unknown)}")
    module = fsdp_collectives_module()
    previous = {name: getattr(module, name) for name in functions}
    for name, fn in functions.items():
        setattr(module, name, fn)
    return previous


@functools.lru_cache(maxsize=None)
def _compiled_autograd_flag():
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return getattr(_fsdp_common, "compiled_autograd_enabled", None)


def compiled_autograd_enabled() -> bool:
    """torch 2.11: whether FSDP2 runs under compiled autograd
    (`_fsdp_common.compiled_autograd_enabled`), where its all-gather inputs take
    another path that the mixed-precision hook must leave to torch. Later
    versions have one path (and no such function): False."""
    enabled = _compiled_autograd_flag()
    return bool(enabled is not None and enabled())


def casts_in_copy_in(fsdp_param) -> bool:
    """FSDP2's own condition for casting a shard with one foreach copy (see
    `_get_param_all_gather_inputs`, 2.11-2.14): mixed precision, not offloaded,
    not an all-gather extension (fp8 weights)."""
    return (fsdp_param.param_dtype is not None and not fsdp_param.offload_to_cpu
            and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"))


@functools.lru_cache(maxsize=None)
def _sharded_state():  # once: all_gather_source runs per parameter per all-gather
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return ShardedState.SHARDED


def all_gather_source(fsdp_param) -> torch.Tensor:
    """The flat shard FSDP2 all-gathers for a parameter: the sharded data, or
    the post-forward (resharded to a smaller group) data between forward and
    backward with an integer reshard_after_forward."""
    if fsdp_param.sharded_state == _sharded_state():
        return fsdp_param._sharded_param_data
    return fsdp_param._sharded_post_forward_param_data


# ------------------------------------------------------------------ tensor subclasses and private ops

def make_wrapper_subclass(cls, shape, **kwargs):
    """`torch.Tensor._make_wrapper_subclass`: how every wrapper subclass (torchao's,
    DTensor) is made; there is no public spelling."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)


def parameter_initializer(module: nn.Module):
    """The method that initializes `module`'s own parameters, or None: `reset_parameters()`, or
    `_reset_parameters()` as torch's MultiheadAttention names it (NVIDIA Megatron-FSDP's
    convention for meta-device initialization accepts both)."""
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def version_counter(t: torch.Tensor) -> int:
    """`Tensor._version`: bumped by every in-place write to the tensor (what autograd checks
    saved tensors with); the fp8 weight keeps its cast bytes while it is unchanged."""
    return t._version


DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def tree_map_only(types, fn, tree):
    """`torch.utils._pytree.tree_map_only` (what torch's own subclasses use)."""
    from torch.utils import _pytree

    return _pytree.tree_map_only(types, fn, tree)


def tree_leaves(tree) -> list:
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


def scaled_mm(a, b, scale_a, scale_b, out_dtype, out=None):
    """`torch._scaled_mm` (schema unchanged 2.11-2.14): fp8 GEMM with float32
    inverse scales; `F.scaled_mm`'s recipe API is a different contract."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, out=out)


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: `torch._grouped_mm`'s backward
    rejects an expanded one (the gradient of a `.sum()`, say)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=offs)` (torch 2.13's `F.grouped_mm` calls it; read on 2.13,
    its other versions unverified here): rows offs[g-1]:offs[g] of the 2D `a` times `b[g]` for the 3D `b`
    ([groups, K, N], a transposed view of a contiguous [groups, N, K] weight), differentiable.
    `offs`: int32 cumulative row counts on `a`'s device."""
    return _ContiguousGradient.apply(torch._grouped_mm(a, b, offs=offs))


def flash_attention_with_lse(q, k, v, *, causal: bool, scale: float):
    """SDPA's flash kernel (no dropout), returning what its backward needs: (output, lse [b, h, s]
    fp32, saved). CPU: `aten._scaled_dot_product_flash_attention_for_cpu`; CUDA (fp16/bf16):
    `aten._scaled_dot_product_flash_attention`, whose sequence offsets and RNG state are `saved`.
    Schemas unchanged 2.11-2.14."""
    if q.device.type == "cuda":
        out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, tuple(rest[:6])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def flash_attention_with_lse_backward(dout, q, k, v, out, lse, saved, *, causal: bool, scale: float):
    """The flash kernel's backward: dQ, dK, dV given the output and lse of the whole row (for one
    block of a longer row: the merged ones) and flash_attention_with_lse's `saved`."""
    if q.device.type == "cuda":
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def foreach_norm(tensors, ord, dtype: Optional[torch.dtype] = None) -> list:
    """`torch._foreach_norm`: each tensor's norm, accumulated and returned in `dtype` (None: the
    tensor's own). An empty tensor's norm is 0, which the op refuses to give for the infinity norm
    (no identity) although a shard of a parameter smaller than its mesh is empty."""
    full = [t for t in tensors if t.numel()]
    norms = iter(torch._foreach_norm(full, ord, dtype=dtype) if full else ())
    return [next(norms) if t.numel() else t.new_zeros((), dtype=dtype or t.dtype) for t in tensors]


def foreach_mul_(tensors, scalar) -> None:
    """`torch._foreach_mul_` (what torch's clip_grad_norm_ scales with): one op for the
    list (multi-tensor kernels where its tensors share a device and dtype)."""
    torch._foreach_mul_(tensors, scalar)


def amp_non_finite_check_and_unscale_(grads, found_inf, inv_scale) -> None:
    """`torch._amp_foreach_non_finite_check_and_unscale_` (what torch's GradScaler uses)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def cuda_arch_flags() -> str:
    """The architectures this torch was built for ("sm_80 sm_90 ..."), also with no GPU
    visible (`torch.cuda.get_arch_list()` is empty then): `torch._C._cuda_getArchFlags`,
    which exists in CUDA builds only. setup.py reads it to choose what to compile for."""
    flags = getattr(torch._C, "_cuda_getArchFlags", None)
    try:
        return (flags() if flags is not None else "") or " ".join(torch.cuda.get_arch_list())
    except RuntimeError:
        return ""


def create_chunk_list(tensor):
    """`checkpoint.planner_helpers._create_chunk_list`: the chunks a (D)Tensor
    holds, as DCP's planner describes them."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    return _create_chunk_list(tensor)


def set_state_dict_element(state_dict: dict, path, value) -> None:
    """`checkpoint._traverse.set_element`: put `value` at `path` of a nested state dict, where
    DCP's DefaultLoadPlanner puts a non-tensor value it loaded into a flattened state dict."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state_dict, path, value)


def dcp_metadata_path(reader, rank: Optional[int]):
    """`FileSystemReader._get_metadata_path`: the path of the checkpoint's `.metadata` file (or
    rank's), as FileSystemReader.read_metadata opens it (torch 2.11-2.14 alike)."""
    return reader._get_metadata_path(rank)


def is_extra_state_placeholder(value) -> bool:
    """`checkpoint.state_dict._EXTRA_STATE`: what set_model_state_dict with
    full_state_dict=True hands a module's set_extra_state (it carries no extra
    state across ranks); the module then keeps its own."""
    from torch.distributed.checkpoint.state_dict import _EXTRA_STATE

    return isinstance(value, _EXTRA_STATE)


# ------------------------------------------------------------------ memory history and the Flight Recorder

def record_cuda_memory_history(max_entries: int) -> None:
    """Record the CUDA caching allocator's history from now on (`cuda.memory._record_memory_history`,
    the same arguments 2.11-2.14): every allocation and free with its Python and C++ stack, the
    newest `max_entries` kept; what `cuda_memory_snapshot()` returns and pytorch.org/memory_viz draws."""
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=max_entries)


def stop_cuda_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def cuda_memory_snapshot() -> dict:
    """The allocator's segments and the recorded history (`cuda.memory._snapshot`): the object
    `torch.cuda.memory._dump_snapshot` pickles and the memory_viz page loads."""
    return torch.cuda.memory._snapshot()


def flight_recorder_trace(backend: str) -> Optional[bytes]:
    """This process's Flight Recorder record of `backend`'s collectives as torch dumps it on a
    timeout (a pickle that `python -m torch.distributed.flight_recorder.fr_trace` reads), or None
    where this torch keeps none for it. Two recorders: NCCL's own (`_distributed_c10d._dump_nccl_trace`,
    CUDA builds) and the generic one every other backend, gloo included, records into
    (`_dump_fr_trace`, torch >= 2.8)."""
    from torch._C import _distributed_c10d

    dump = getattr(_distributed_c10d, "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace", None)
    return None if dump is None else dump()
