"""Scale updates after each optimizer step, and the fp8 state checkpoints keep.

`refresh_fp8_scales(model)` computes the amax of every fp8 training weight
shard in one fused pass (`kernels.amax.multi_tensor_amax`), stacks them with
the amaxes the delayed-scaling histories recorded during the step, and
reduces all of them with ONE all-reduce (MAX) over the ranks that shard the
weights (data x tensor parallel, parallel_state's amax-reduction group). So
every rank holding a shard of a weight casts it with the same scale, and the
histories are the same on every rank. MegatronOptimizer.step() calls it
(the converter's post-step hook).

`refresh_fp8_weight_scales(model)` recomputes the weight scales alone, after
the weights changed outside a step (a load, a broadcast: the converter's hooks).

Checkpoints keep the master weights (the weights' state-dict hook saves them
as plain tensors) and the delayed-scaling histories, the same on every rank,
as each linear's extra state (convert.Fp8Linear). `fp8_state_dict(model)`
and `load_fp8_state_dict(model, state)` (None or {}: fresh histories; also
recomputes the weight scales) read and write them as one dict by module
name: the form common.pt held them in before they became module state.
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import _torch_compat, parallel_state
from ..kernels.amax import multi_tensor_amax
from ..utils import is_distributed, unwrap_model
from .linear import _fp8_linears
from .scaling import scale_from_amax
from .weight import Fp8TrainingWeight

Modules = Union[nn.Module, Iterable[nn.Module]]


def _as_list(models: Modules) -> list[nn.Module]:
    return [unwrap_model(m) for m in ([models] if isinstance(models, nn.Module) else list(models))]


def has_fp8_linears(models: Modules) -> bool:
    return any(_fp8_linears(m) for m in _as_list(models))


def _default_group() -> Optional[dist.ProcessGroup]:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_amax_reduction_group(with_context_parallel=True)
    return None  # the default group


def _master_shard(name: str, linear: nn.Module) -> Fp8TrainingWeight:
    weight = getattr(linear, "weight", None)  # the registered (sharded) parameter
    local = _torch_compat.local_tensor(weight)
    if not isinstance(local, Fp8TrainingWeight):
        raise RuntimeError(
            f"refresh_fp8_scales: {name}.weight was converted to an fp8 training weight but the module now "
            f"holds a {type(local).__name__}: call it while parameters are sharded (not between an FSDP "
            "forward and its backward), and do not replace converted weights")
    return local


@torch.no_grad()
def _refresh(models: Modules, group, update_histories: bool) -> None:
    weights, histories = [], []
    for model in _as_list(models):
        for name, linear in _fp8_linears(model):
            state = linear.fp8_state
            if state.converted_weight:
                weights.append(_master_shard(name, linear))
            if update_histories:
                histories += [h for _, h in state.histories()]
    if not weights and not histories:
        return
    device = weights[0]._data.device if weights else parallel_state.get_device_or_cpu()
    amaxes = [multi_tensor_amax([w._data for w in weights]).to(device)] if weights else []
    amaxes += [torch.stack([h.pending_amax(device) for h in histories])] if histories else []
    amax = torch.cat(amaxes) if len(amaxes) > 1 else amaxes[0]
    if is_distributed():
        group = _default_group() if group is None else group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    if weights:
        previous = torch.stack([w._fp8_meta.scale.to(device) if w._fp8_meta.scale is not None
                                else torch.ones((), device=device) for w in weights])
        by_format = {}
        for i, w in enumerate(weights):
            by_format.setdefault((w._fp8_meta.fp8_dtype, w._fp8_meta.margin), []).append(i)
        scales = torch.empty_like(previous)
        for (fp8_dtype, margin), index in by_format.items():
            index = torch.tensor(index, device=device)
            scales[index] = scale_from_amax(amax[index], fp8_dtype, margin, previous[index])
        for w, s in zip(weights, scales.unbind()):
            meta = w._fp8_meta
            if meta.scale is None:
                meta.scale = s.clone()
            else:
                meta.scale.copy_(s)
    for h, a in zip(histories, amax[len(weights):].unbind()):
        h.update(a)


def refresh_fp8_scales(models: Modules, group: Optional[dist.ProcessGroup] = None) -> None:
    """After an optimizer step: recompute every fp8 weight's scale from its
    new values and advance the delayed-scaling histories by the step's
    amaxes. Collective over `group` (default: parallel_state's amax-reduction
    group, data x tensor x context parallel; the default group when
    parallel_state is not initialized); a no-op for a model without fp8
    training weights or delayed scaling. `models`: a module, a wrapped model,
    or a list of them (model chunks)."""
    _refresh(models, group, update_histories=True)


def refresh_fp8_weight_scales(models: Modules, group: Optional[dist.ProcessGroup] = None) -> None:
    """After the weights changed outside an optimizer step (a load, a broadcast):
    recompute every fp8 weight's scale from its values, histories untouched.
    Collective over `group` as refresh_fp8_scales; a no-op without fp8 training weights."""
    _refresh(models, group, update_histories=False)


def fp8_state_dict(models: Modules) -> dict:
    """The delayed-scaling histories by module name ({} under "tensorwise"):
    the same on every rank, so one rank's copy is the checkpoint's."""
    state = {}
    for i, model in enumerate(_as_list(models)):
        for name, linear in _fp8_linears(model):
            roles = {role: h.state_dict() for role, h in linear.fp8_state.histories()}
            roles = {role: s for role, s in roles.items() if s}
            if roles:
                state[f"{i}.{name}" if i else name] = roles
    return state


def load_fp8_state_dict(models: Modules, state: Optional[dict], group: Optional[dist.ProcessGroup] = None) -> None:
    """After a checkpoint load (collective, every rank): restore the histories
    `fp8_state_dict` saved (`state` None or {}: start them fresh; entries for
    modules that do not run fp8 are ignored) and recompute every fp8 weight's
    scale from the loaded weights."""
    state = state or {}
    models = _as_list(models)
    device = parallel_state.get_device() if parallel_state.model_parallel_is_initialized() else torch.device("cpu")
    for i, model in enumerate(models):
        for name, linear in _fp8_linears(model):
            saved = state.get(f"{i}.{name}" if i else name, {})
            for role, history in linear.fp8_state.histories():
                history.load_state_dict(saved.get(role, {}), device)
    refresh_fp8_weight_scales(models, group)
