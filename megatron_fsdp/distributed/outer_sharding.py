"""HFSDP: the optimizer's share of each FSDP shard, sharded again across the outer
data-parallel dimension (NVIDIA Megatron-FSDP's `outer_dp_sharding_strategy="optim"`).

FSDP2 shards each parameter over the inner (`dp_shard_dim`) ranks and reduce-scatters its
gradient there. The replicas of one shard across the outer dimension (`dp_outer_dim`) are
cut again into `outer` pieces, and each rank's optimizer updates only its own piece:

  gradients  after backward, one reduce-scatter across the outer dimension per dtype: each
             piece receives the mean over the outer ranks (the sum with per-token loss), and
             the model's sharded gradients are dropped
  step       the optimizer updates its pieces in place: each is a view of its FSDP shard
  weights    after the step, one all-gather of the pieces across the outer dimension per
             dtype puts the updated shards together on every replica

So the optimizer state, and the gradients it reads, take 1 / (outer x inner) of the model
on each rank where HSDP's take 1 / inner; the weights (FSDP2's sharded parameters, which are
the main weights) stay 1 / inner.

Each piece is a DTensor on the outer dimension and its parameter's own mesh dimensions,
sharded on every one of them its parameter is sharded on, so that what an optimizer does
with it (elementwise updates) and a gradient norm over the optimizer's parameters
(optimizer/clip_grads.py) are right: the norm reduces over every rank holding a piece. Its
global layout is not the parameter's (a piece of an uneven row shard has none DTensor can
describe): read weights from the model and state from `optimizer.state_dict()`, never a
piece's `full_tensor()`. The optimizer's state dict holds each state tensor in its
parameter's layout (gathered across the outer dimension for the occasion, so a copy:
`optimizer.load_state_dict` puts a loaded one back), the layout FSDP's and HSDP's hold: a
checkpoint loads into any data-parallel layout, and theirs into this one.

Whether a parameter has a gradient is agreed across the outer dimension before each
reduction (a parameter unused on one replica's data still gets the others' gradient), so
every rank issues the same collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


@dataclasses.dataclass(eq=False)
class _Slot:
    """One parameter: FSDP2's shard of it on this rank, and this rank's piece of that shard."""

    index: int  # in the model's parameter order: the order of the coalesced collectives
    param: nn.Parameter  # FSDP2's sharded parameter (a DTensor)
    piece: nn.Parameter  # what the optimizer updates: a DTensor whose local tensor views the shard
    numel: int  # elements in this rank's shard
    chunk: int  # elements per piece; the last pieces of a shard may hold fewer, or none
    start: int  # this rank's piece: [start, end) of the flattened shard
    end: int
    offset: int  # the piece's column in the coalesced buffer of its dtype

    def shard(self) -> torch.Tensor:
        return self.param.to_local().view(-1)

    def as_piece(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, self.piece.device_mesh, self.piece.placements, run_check=False,
                                  shape=self.piece.shape, stride=self.piece.stride())

    def as_param(self, flat: torch.Tensor) -> DTensor:
        local = flat.view(self.param.to_local().shape)
        return DTensor.from_local(local, self.param.device_mesh, self.param.placements, run_check=False,
                                  shape=self.param.shape, stride=self.param.stride())


def _pack(columns: torch.Tensor, flat: torch.Tensor, chunk: int) -> None:
    """Row k of `columns` (outer x chunk) takes piece k of `flat`; a short last row stays as it is."""
    full = flat.numel() // chunk if chunk else 0
    columns[:full].copy_(flat[:full * chunk].view(full, chunk))
    if full * chunk < flat.numel():
        columns[full, :flat.numel() - full * chunk].copy_(flat[full * chunk:])


def _unpack(columns: torch.Tensor, flat: torch.Tensor, chunk: int) -> None:
    full = flat.numel() // chunk if chunk else 0
    flat[:full * chunk].view(full, chunk).copy_(columns[:full])
    if full * chunk < flat.numel():
        flat[full * chunk:].copy_(columns[full, :flat.numel() - full * chunk])


class OuterShardedOptimizerState:
    """The pieces of a fully_shard model's parameters, and the hooks that keep an optimizer
    on them (`adopt`, then `install_hooks`). Built once per model; communicates only in
    `reduce_gradients`, `gather_weights` and the optimizer's state-dict hooks."""

    def __init__(self, params: list[nn.Parameter], device_mesh: DeviceMesh, outer_dim: str,
                 group: dist.ProcessGroup, *, mean: bool, comm_dtype: Optional[torch.dtype]):
        self.group = group
        self.outer = dist.get_world_size(group)
        self.mean = mean  # divide the outer sum by the outer size (not with per-token loss)
        self.comm_dtype = comm_dtype
        self.optimizer: Optional[torch.optim.Optimizer] = None
        rank = dist.get_rank(group)
        self._slots: list[_Slot] = []
        self._by_dtype: dict[torch.dtype, list[_Slot]] = {}
        widths: dict[torch.dtype, int] = {}
        for param in params:
            if not isinstance(param, DTensor) or not param.to_local().is_contiguous():
                raise ValueError(f"outer_dp_sharding_strategy='optim': a parameter of shape {tuple(param.shape)} "
                                 "is not a contiguous FSDP shard")
            numel = param.to_local().numel()
            chunk = -(-numel // self.outer)
            start = min(rank * chunk, numel)
            end = min(start + chunk, numel)
            names = (outer_dim, *param.device_mesh.mesh_dim_names)
            placements = (Shard(0), *(p if p.is_replicate() else Shard(0) for p in param.placements))
            with torch.no_grad():
                local = param.to_local().view(-1)[start:end]
                piece = nn.Parameter(DTensor.from_local(local, device_mesh[names], placements, run_check=False,
                                                        shape=(param.numel(),), stride=(1,)),
                                     requires_grad=param.requires_grad)
            slot = _Slot(len(self._slots), param, piece, numel, chunk, start, end, widths.get(param.dtype, 0))
            widths[param.dtype] = slot.offset + chunk
            self._slots.append(slot)
            self._by_dtype.setdefault(param.dtype, []).append(slot)
        self._widths = widths
        self._by_piece = {id(s.piece): s for s in self._slots}
        self._by_param = {id(s.param): s for s in self._slots}

    @property
    def attached(self) -> bool:
        return self.optimizer is not None

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Point `optimizer`'s parameter groups at the pieces of the parameters they hold."""
        if self.optimizer is not None:
            raise ValueError("outer_dp_sharding_strategy='optim': this model's parameters are already in an "
                             "optimizer; shard one optimizer per model")
        for group in optimizer.param_groups:
            foreign = [tuple(p.shape) for p in group["params"] if id(p) not in self._by_param]
            if foreign:
                raise ValueError("outer_dp_sharding_strategy='optim': the optimizer also holds parameters of another "
                                 f"model (shapes {foreign[:3]}); build one optimizer per HFSDP model")
        for group in optimizer.param_groups:
            group["params"] = [self._by_param[id(p)].piece for p in group["params"]]
        self.optimizer = optimizer

    def install_hooks(self) -> None:
        """Reduce before each step, gather after it; state dicts in the parameters' layout."""
        optimizer = self.optimizer
        optimizer.register_step_pre_hook(lambda *_: self.reduce_gradients())
        optimizer.register_step_post_hook(lambda *_: self.gather_weights())
        optimizer.register_state_dict_post_hook(lambda _, state_dict: self._state_to_param_layout(state_dict))
        optimizer.register_load_state_dict_pre_hook(lambda _, state_dict: self._state_to_pieces(state_dict))

    def _buffer(self, param_dtype: torch.dtype, rows: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """`rows` x the coalesced width of the `param_dtype` parameters, in `dtype` (theirs by default)."""
        device = self._by_dtype[param_dtype][0].param.to_local().device
        return torch.zeros(rows, self._widths[param_dtype], dtype=dtype or param_dtype, device=device)

    def _check_views(self) -> None:
        """The pieces must still be views of the shards: something that reallocates the model's
        parameters after fully_shard (`module.to(...)`) would leave the optimizer stepping copies."""
        for s in self._slots:
            if s.end > s.start and s.piece.to_local().data_ptr() != s.shard()[s.start:].data_ptr():
                raise RuntimeError("outer_dp_sharding_strategy='optim': the model's sharded parameters were "
                                   "reallocated after fully_shard (a .to() or load_state_dict(assign=True)?), so the "
                                   "optimizer no longer steps them; move, cast or assign before fully_shard")

    def _agree_on_gradients(self) -> list[bool]:
        """Which parameters have a gradient on some rank of the outer dimension (one small
        all-reduce): those are reduced, with zeros where a rank has none, and stepped everywhere."""
        device = self._slots[0].param.to_local().device if self._slots else torch.device("cpu")
        has = torch.tensor([s.param.grad is not None for s in self._slots], dtype=torch.int32, device=device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.group)
        return has.bool().tolist()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """The model's sharded gradients, reduced across the outer dimension into the pieces'
        gradients (added to what they hold, as autograd would); then the model's are dropped,
        so a second call with no backward in between changes nothing."""
        self._check_views()
        has_grad = self._agree_on_gradients()
        for dtype, slots in self._by_dtype.items():
            slots = [s for s in slots if has_grad[s.index]]
            if not slots:
                continue
            comm_dtype = self.comm_dtype or dtype
            send = self._buffer(dtype, self.outer, comm_dtype)
            for s in slots:
                if s.param.grad is not None:
                    _pack(send[:, s.offset:s.offset + s.chunk], s.param.grad.to_local().view(-1), s.chunk)
            # fp16 sums can overflow: divide first there (fp32 and bf16 have the range to divide after).
            pre_divide = self.mean and comm_dtype == torch.float16
            if pre_divide:
                send.div_(self.outer)
            received = self._buffer(dtype, 1, comm_dtype).view(-1)
            dist.reduce_scatter_tensor(received, send.view(-1), op=dist.ReduceOp.SUM, group=self.group)
            if self.mean and not pre_divide:
                received.div_(self.outer)
            received = received.to(dtype)
            for s in slots:
                grad = s.as_piece(received[s.offset:s.offset + s.end - s.start])
                if s.piece.grad is None:
                    s.piece.grad = grad
                else:
                    s.piece.grad += grad
                s.param.grad = None

    @torch.no_grad()
    def scale_gradients(self, factor: float) -> None:
        for s in self._slots:
            if s.piece.grad is not None:
                s.piece.grad.mul_(factor)

    def _gather(self, pieces: dict[int, torch.Tensor], into: dict[int, torch.Tensor]) -> None:
        """`into[i]` (slot i's flattened shard) := slot i's pieces from every outer rank, where
        `pieces[i]` is this rank's (in the parameter's dtype); one all-gather per dtype, the
        slots in the same order on every rank."""
        for dtype, slots in self._by_dtype.items():
            slots = [s for s in slots if s.index in pieces]
            if not slots:
                continue
            send = self._buffer(dtype, 1).view(-1)
            for s in slots:
                if pieces[s.index].dtype != dtype:
                    raise ValueError(f"outer_dp_sharding_strategy='optim': a tensor of dtype "
                                     f"{pieces[s.index].dtype} for a {dtype} parameter")
                send[s.offset:s.offset + s.end - s.start].copy_(pieces[s.index])
            received = self._buffer(dtype, self.outer)
            dist.all_gather_into_tensor(received.view(-1), send, group=self.group)
            for s in slots:
                _unpack(received[:, s.offset:s.offset + s.chunk], into[s.index], s.chunk)

    @torch.no_grad()
    def gather_weights(self) -> None:
        """Every replica's shards := the pieces the optimizer updated. (The step's pre-hook,
        reduce_gradients, checked just before that the pieces still view the shards.)"""
        self._gather({s.index: s.piece.to_local() for s in self._slots}, {s.index: s.shard() for s in self._slots})

    def zero_grad(self) -> None:
        for s in self._slots:
            s.piece.grad = None

    def _indexed_slots(self) -> list[_Slot]:
        """The slots in the order the optimizer's state dict numbers its parameters."""
        return [self._by_piece[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def _state_to_param_layout(self, state_dict: dict) -> dict:
        slots = self._indexed_slots()
        live = state_dict["state"]  # the optimizer's own per-parameter dicts and tensors

        def is_piece(index, value):
            return isinstance(value, DTensor) and value.shape == slots[index].piece.shape

        # Gathered tensors are new; the rest ("step") are copied too, so that a DCP load into this
        # dict without `optimizer.load_state_dict` restores nothing rather than steps without moments.
        state = {i: {k: v.clone() if torch.is_tensor(v) and not is_piece(i, v) else v for k, v in entries.items()}
                 for i, entries in live.items()}
        keys = sorted({key for i, entries in live.items() for key, value in entries.items() if is_piece(i, value)})
        for key in keys:  # one gather per state key (Adam: exp_avg, exp_avg_sq) and dtype
            held = {i: entries[key] for i, entries in live.items() if key in entries}
            pieces = {slots[i].index: value.to_local() for i, value in held.items()}
            into = {slots[i].index: torch.empty(slots[i].numel, dtype=value.dtype, device=value.device)
                    for i, value in held.items()}
            self._gather(pieces, into)
            for i in held:
                state[i][key] = slots[i].as_param(into[slots[i].index])
        return {**state_dict, "state": state}

    def _state_to_pieces(self, state_dict: dict) -> dict:
        slots = self._indexed_slots()
        state = {}
        for index, entries in state_dict["state"].items():
            slot = slots[index]
            state[index] = dict(entries)
            for key, value in entries.items():
                if not torch.is_tensor(value) or value.shape != slot.param.shape or value.dim() == 0:
                    continue
                if not isinstance(value, DTensor) or value.to_local().numel() != slot.numel:
                    raise ValueError(f"optimizer state {key!r} of parameter {index} (shape {tuple(value.shape)}) is "
                                     "not laid out like the sharded parameter: load it with DCP into "
                                     "optimizer.state_dict() (outer_dp_sharding_strategy='optim')")
                state[index][key] = slot.as_piece(value.to_local().reshape(-1)[slot.start:slot.end].clone())
        return {**state_dict, "state": state}
