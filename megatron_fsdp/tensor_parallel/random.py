"""RNG streams for model parallelism, on CPU and CUDA alike.

Two streams matter (Megatron's scheme): the default generator, seeded the same
on every tensor-parallel rank, drives dropout on replicated activations; the
tracked "model-parallel-rng" stream, seeded differently per TP rank, drives
dropout on activations that are split across TP ranks (attention heads, or
everything under sequence parallelism). The tracker swaps the state of the
generator of the device the model runs on: the CPU generator under gloo, the
current CUDA generator under NCCL.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.utils.checkpoint

from .. import parallel_state

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"


def _device_type() -> str:
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_device_type()
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_rng_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_rng_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states that `fork()` swaps into the device's default generator.

    Kept under Megatron's name; it tracks the CPU generator when the model
    runs on CPU.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, tuple[str, torch.Tensor]] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict[str, tuple[str, torch.Tensor]]:
        return {name: (dev, state.clone()) for name, (dev, state) in self.states_.items()}

    def set_states(self, states: dict[str, tuple[str, torch.Tensor]]) -> None:
        self.states_ = {name: (dev, state.clone()) for name, (dev, state) in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        device_type = _device_type()
        saved = _get_rng_state(device_type)
        try:
            if device_type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.random.default_generator.manual_seed(seed)
            self.states_[name] = (device_type, _get_rng_state(device_type))
        finally:
            _set_rng_state(device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise KeyError(
                f"RNG state {name!r} is not tracked; call "
                "megatron_fsdp.tensor_parallel.model_parallel_cuda_manual_seed(seed) first"
            )
        device_type, state = self.states_[name]
        saved = _get_rng_state(device_type)
        _set_rng_state(device_type, state)
        try:
            yield
        finally:
            self.states_[name] = (device_type, _get_rng_state(device_type))
            _set_rng_state(device_type, saved)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()
# Its streams are seeded per TP rank: stale once the groups are gone.
parallel_state.on_destroy_model_parallel(_CUDA_RNG_STATE_TRACKER.reset)


def get_cuda_rng_tracker(use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False,
                         use_cudagraphable_rng: bool = False) -> CudaRNGStatesTracker:
    if use_te_rng_tracker or inference_rng_tracker or use_cudagraphable_rng:
        raise NotImplementedError(
            "only the default RNG tracker is available (use_te_rng_tracker, "
            "inference_rng_tracker and use_cudagraphable_rng must be False)"
        )
    return _CUDA_RNG_STATE_TRACKER


def get_expert_parallel_rng_tracker_name() -> str:
    """The tracked stream of mixture-of-experts layers: different on every expert-tensor and
    expert-model parallel rank, the same across expert-data-parallel ranks (Megatron's)."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def model_parallel_cuda_manual_seed(seed: int, te_rng_tracker: bool = False,
                                    inference_rng_tracker: bool = False,
                                    use_cudagraphable_rng: bool = False,
                                    tp_rank: Optional[int] = None, ep_rank: Optional[int] = None,
                                    etp_rank: Optional[int] = None,
                                    force_reset_rng: bool = False) -> None:
    """Seed the device generator with `seed`, the tracked TP stream with `seed + 2718 + tp_rank`
    and the expert stream with `seed + 1024 + 100 * ep_rank + etp_rank` (Megatron's offsets;
    ranks default to this rank's in parallel_state), on CPU or CUDA."""
    tracker = get_cuda_rng_tracker(te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    for name, rank in (("tp_rank", tp_rank), ("ep_rank", ep_rank), ("etp_rank", etp_rank)):
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise ValueError(f"{name} must be None or a non-negative integer, got {rank!r}")
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep_rank is None else ep_rank
    etp_rank = parallel_state.get_expert_tensor_parallel_rank() if etp_rank is None else etp_rank
    tensor_model_parallel_seed = seed + 2718 + tp_rank
    expert_parallel_seed = seed + 1024 + 100 * ep_rank + etp_rank
    tracker.reset()
    if _device_type() == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.random.default_generator.manual_seed(seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)


# How many checkpoint() recomputations are running now (nested checkpoints recompute inside one).
_RECOMPUTING = 0


def in_activation_recomputation() -> bool:
    """Whether checkpoint() is recomputing a forward now. Its recomputation runs with autograd on
    (non-reentrant checkpointing), so code with side effects of a forward (the MoE router's
    auxiliary-loss logging and expert-bias token counts) asks this to do them once."""
    return _RECOMPUTING > 0


class _TrackerStatesForRecompute:
    """torch.utils.checkpoint restores the default generators, not our tracked
    states; without this, dropout inside a tracker fork would draw a different
    mask during recomputation and the gradients would be wrong."""

    def __init__(self):
        self.saved = None

    @contextlib.contextmanager
    def forward(self):
        self.saved = get_cuda_rng_tracker().get_states()
        yield

    @contextlib.contextmanager
    def recompute(self):
        global _RECOMPUTING
        tracker = get_cuda_rng_tracker()
        current = tracker.get_states()
        tracker.set_states(self.saved)
        _RECOMPUTING += 1
        try:
            yield
        finally:
            _RECOMPUTING -= 1
            tracker.set_states(current)


def checkpoint(function: Callable, distribute_saved_activations: bool, *args):
    """Activation checkpointing that replays dropout exactly (Megatron's signature)."""
    if distribute_saved_activations:
        raise NotImplementedError("distribute_saved_activations=True is not supported")
    states = _TrackerStatesForRecompute()
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (states.forward(), states.recompute()),
    )
