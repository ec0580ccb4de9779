"""fp8 training weights: high-precision master weights that FSDP2 all-gathers in fp8.

`Fp8TrainingWeight` wraps the fp32 (or bf16) master weight. It behaves as
that tensor for every op (the optimizer steps the data inside), and
implements FSDP2's all-gather extension (torch >= 2.9, five-argument hook):

- `fsdp_pre_all_gather` casts this rank's shard to fp8 with the weight's
  precomputed scale (`Fp8WeightMeta.scale`, the same on every rank that holds
  a shard of the weight; see refresh.py) once per step (the cast bytes serve
  every all-gather until the weight or its scale is written) and hands FSDP a `uint8` view (gloo
  cannot move float8 tensors, and one dtype lets FSDP pack a unit's tensors
  together). A short shard is zero-padded to the padded shard's rows, as
  FSDP requires of uneven shards. The scale travels as metadata.
- `fsdp_post_all_gather` returns an `Fp8GatheredWeight`: the gathered fp8
  bytes (a view of FSDP's all-gather buffer) plus the scale, ready for the
  fp8 GEMM. On later gathers FSDP refills the same buffer and the hook only
  updates the scale of `out` in place (its local tensor with tensor
  parallelism): a new return value would be ignored.

The all-gather moves one byte per weight element: half of bf16.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _torch_compat
from .scaling import cast_to_fp8, dequantize

aten = torch.ops.aten

# Ops whose results are the same weight (views, shards, FSDP's padding buffers,
# to_empty's materialization, module.to()/float()): they stay
# Fp8TrainingWeights sharing the weight's meta. Everything else returns plain
# tensors: optimizer states (zeros_like) and copies (clone) included.
_SAME_WEIGHT_OPS = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default, aten.empty_like.default,
    aten._to_copy.default, aten._pin_memory.default,
}


class Fp8WeightMeta:
    """Shared by every view and shard of one fp8 training weight."""

    def __init__(self, fp8_dtype: torch.dtype, margin: int):
        self.fp8_dtype = fp8_dtype
        self.margin = margin
        self.scale: Optional[torch.Tensor] = None  # set by refresh_fp8_scales


def _wrapper(cls, data: torch.Tensor, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    return _torch_compat.make_wrapper_subclass(
        cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=dtype,
        layout=data.layout, device=data.device, requires_grad=requires_grad)


class Fp8TrainingWeight(torch.Tensor):
    """A master weight (fp32/bf16 `_data`) that is all-gathered and used in fp8."""

    _data: torch.Tensor
    _fp8_meta: Fp8WeightMeta

    @staticmethod
    def __new__(cls, data: torch.Tensor, meta: Fp8WeightMeta):
        return _wrapper(cls, data, data.dtype, data.requires_grad)

    def __init__(self, data: torch.Tensor, meta: Fp8WeightMeta):
        self._data = data
        self._fp8_meta = meta

    __torch_function__ = _torch_compat.DISABLED_TORCH_FUNCTION

    def __repr__(self) -> str:
        return f"Fp8TrainingWeight({self._data!r}, fp8_dtype={self._fp8_meta.fp8_dtype})"

    def __tensor_flatten__(self):
        return ["_data"], {"meta": self._fp8_meta}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8TrainingWeight(inner["_data"], ctx["meta"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = next(t._fp8_meta for t in _torch_compat.tree_leaves((args, kwargs)) if isinstance(t, cls))
        unwrapped_args, unwrapped_kwargs = _torch_compat.tree_map_only(cls, lambda t: t._data, (args, kwargs))
        out = func(*unwrapped_args, **unwrapped_kwargs)
        if func in _SAME_WEIGHT_OPS:
            return _torch_compat.tree_map_only(torch.Tensor, lambda t: cls(t, meta), out)
        if func.overloadpacket.__name__.endswith("_") and args and isinstance(args[0], cls) and out is not None:
            return args[0]  # an in-place op (optimizer update, load) returns the weight itself
        return out

    def fp8_scale(self) -> torch.Tensor:
        """The precomputed scale this weight is cast to fp8 with (see refresh.py)."""
        if self._fp8_meta.scale is None:
            raise RuntimeError(
                "fp8 weight has no scale yet: call megatron_fsdp.fp8.refresh_fp8_scales(model) once the "
                "weights hold their values (TorchFullyShardedDataParallel does after sharding, "
                "MegatronOptimizer.step after every step)")
        return self._fp8_meta.scale

    def cast_to_fp8(self, out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp8 data, scale) of this weight with its precomputed scale; `out`
        as in scaling.cast_to_fp8."""
        scale = self.fp8_scale()
        return cast_to_fp8(self._data, scale, self._fp8_meta.fp8_dtype, out=out), scale

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows = self._data.size(0)
        padded_rows = -(-outer_size[0] // mesh.size())
        scale = self.fp8_scale()
        # The weight changes only when its data or its scale is written (the optimizer step, a
        # load, refresh_fp8_scales), and every write bumps a version: the other all-gathers of a
        # step (each microbatch's, the backward's after resharding) send the bytes of the first
        # cast. Kept between steps: one byte per element of this rank's shard.
        key = (self._data.data_ptr(), _torch_compat.version_counter(self._data), scale.data_ptr(),
               _torch_compat.version_counter(scale), padded_rows)
        cached = self.__dict__.get("_fp8_shard")
        if cached is None or cached[0] != key:
            # The cast writes straight into the (padded) all-gather input.
            padded = torch.empty((padded_rows,) + tuple(self._data.shape[1:]), dtype=torch.uint8,
                                 device=self._data.device)
            padded[rows:].zero_()
            self.cast_to_fp8(out=padded[:rows].view(-1))
            cached = self._fp8_shard = (key, padded)
        return (cached[1],), (scale, self._fp8_meta.fp8_dtype)

    @torch.no_grad()
    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (gathered,), (scale, fp8_dtype) = all_gather_outputs, metadata
        data = gathered.view(fp8_dtype)
        if out is None:
            # FSDP narrows this to the unpadded weight (as_strided) and frees and
            # refills the all-gather buffer underneath it; nothing else to free.
            return Fp8GatheredWeight(data, scale.clone(), param_dtype), ()
        target = _torch_compat.local_tensor(out)
        if not isinstance(target, Fp8GatheredWeight):
            raise RuntimeError(f"fsdp_post_all_gather: expected the previous Fp8GatheredWeight as `out`, "
                               f"got {type(target).__name__}")
        if target._data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
            target._data.copy_(data.reshape(-1)[:target._data.numel()].view(target._data.shape))
        target._scale.copy_(scale)
        return None


class Fp8GatheredWeight(torch.Tensor):
    """An unsharded weight in fp8: `_data` (float8) and `_scale` (value = data / scale).

    It reports the training dtype (`param_dtype`), so its gradients have that
    dtype. The fp8 linear reads `_data` and `_scale` directly; any other op
    sees the dequantized weight and returns plain tensors.
    """

    _data: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return _wrapper(cls, data, dtype, False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self._data = data
        self._scale = scale

    __torch_function__ = _torch_compat.DISABLED_TORCH_FUNCTION

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, fp8_dtype={self._data.dtype}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["_data", "_scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], ctx["dtype"])

    _VIEW_OPS = {aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
                 aten.as_strided.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in cls._VIEW_OPS and isinstance(args[0], cls):
            w = args[0]
            return cls(func(w._data, *args[1:], **kwargs), w._scale, w.dtype)
        dequantized = _torch_compat.tree_map_only(cls, lambda t: dequantize(t._data, t._scale, t.dtype), (args, kwargs))
        return func(*dequantized[0], **dequantized[1])


def is_fp8_training_weight(t: Optional[torch.Tensor]) -> bool:
    local = _torch_compat.local_tensor(t) if t is not None else t
    return isinstance(local, Fp8TrainingWeight)
