"""bench_moe.py's instruments: saved-tensor bytes, the token dispatcher's time per method (forward
and backward), and the grouped GEMM's calls. Each works from outside the library: hooks, wrappers set
on an instance, one module attribute swapped for the duration of a `with`."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_fsdp import _torch_compat

# The dispatcher's protocol, in MoELayer.forward's order: permute, communicate, sort by local
# expert, (the experts), and the mirror images back.
DISPATCH_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                    "token_combine", "combine_postprocess")
COMM_METHODS = ("token_dispatch", "token_combine")


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class SavedTensorBytes:
    """Within it, the bytes of the storages autograd saves for the backward (each once), the
    parameters' storages left out (for DTensor parameters, their local tensors': what the experts
    compute with)."""

    def __init__(self, model: nn.Module):
        self.parameters = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in self.parameters:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class DispatchClock:
    """Intervals of device time: perf_counter on the CPU, CUDA events on the GPU. `now(settle=True)`
    first waits for the queued work and for the other EP ranks (a barrier: `group`, None for none),
    so an interval that starts there counts neither the work before it nor a slower rank's.
    `expert_rows`: the token rows this rank's experts computed (their load, for EP's imbalance)."""

    def __init__(self, cuda: bool, group):
        self.cuda, self.group = cuda, group
        self.intervals: dict[str, list] = defaultdict(list)
        self.expert_rows = 0

    def now(self, settle: bool):
        if settle:
            if self.cuda:
                torch.cuda.synchronize()
            if self.group is not None:
                dist.barrier(group=self.group)
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, name: str, start, end) -> None:
        self.intervals[name].append((start, end))

    def ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {n: sum(s.elapsed_time(e) for s, e in pairs) for n, pairs in self.intervals.items()}
        return {n: 1000 * sum(e - s for s, e in pairs) for n, pairs in self.intervals.items()}


class _Mark(torch.autograd.Function):
    """Identity; its backward calls `hook` once the gradients of all its tensors have arrived."""

    @staticmethod
    def forward(ctx, hook, *tensors):
        ctx.hook = hook
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def _mark(values, hook):
    """`values` (a tensor or a tuple) with its differentiable tensors passed through one _Mark."""
    as_tuple = values if isinstance(values, tuple) else (values,)
    where = [i for i, v in enumerate(as_tuple) if torch.is_tensor(v) and v.requires_grad]
    if not where or not torch.is_grad_enabled():
        return values
    marked = list(as_tuple)
    for i, t in zip(where, _Mark.apply(hook, *(as_tuple[i] for i in where))):
        marked[i] = t
    return tuple(marked) if isinstance(values, tuple) else marked[0]


@contextlib.contextmanager
def profile_dispatcher(layer: nn.Module, clock: DispatchClock):
    """Times each of the dispatcher's methods, forward and backward, into `clock` (see bench_moe.py's
    docstring). A backward interval runs from the method's outputs' gradients (one mark over all
    of them, so the method's backward starts once they are all in) to its inputs'."""
    dispatcher, begun = layer.token_dispatcher, {}

    def wrap(name, method):
        def begin():
            begun[name] = clock.now(settle=True)

        def end():
            clock.add(f"{name}.backward", begun.pop(name), clock.now(settle=False))

        def timed(*args, **kwargs):
            args = _mark(tuple(args), end)
            start = clock.now(settle=True)
            out = method(*args, **kwargs)
            clock.add(f"{name}.forward", start, clock.now(settle=False))
            if name == "dispatch_postprocess":  # (tokens, tokens per local expert (host), probs)
                clock.expert_rows = int(out[1].sum())
            return _mark(out, begin)
        return timed

    for name in DISPATCH_METHODS:
        setattr(dispatcher, name, wrap(name, getattr(dispatcher, name)))
    try:
        yield
    finally:
        for name in DISPATCH_METHODS:
            delattr(dispatcher, name)  # the class's methods again


@contextlib.contextmanager
def count_grouped_mm(counter: list):
    """Counts the experts' calls of _torch_compat.grouped_mm (experts.py looks it up per call)."""
    original = _torch_compat.grouped_mm

    def counted(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    _torch_compat.grouped_mm = counted
    try:
        yield
    finally:
        _torch_compat.grouped_mm = original


