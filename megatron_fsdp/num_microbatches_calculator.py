"""How many microbatches make the current global batch (Megatron-Core's module and API).

One calculator per process, set up once with `init_num_microbatches_calculator`
and read with `get_num_microbatches()`; the training loop calls
`update_num_microbatches(consumed_samples)` before each step so a batch-size
ramp-up (`--rampup-batch-size START INCREMENT SAMPLES`) takes effect.

Ramp-up, as Megatron-LM defines it: the global batch size starts at START and
grows by INCREMENT every SAMPLES / ((GLOBAL - START) / INCREMENT) consumed
samples, reaching the full --global-batch-size once more than SAMPLES samples
have been consumed.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from .utils import check_positive_int

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional["NumMicroBatchesCalculator"] = None


def _calculator() -> "NumMicroBatchesCalculator":
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError("the number-of-microbatches calculator is not initialized: call "
                           "init_num_microbatches_calculator(...) first")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    return _calculator().get()


def get_current_global_batch_size() -> int:
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    return _calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    """The global batch size actually run: smaller than the current global
    batch size only with `decrease_batch_size_if_needed`."""
    return _calculator().get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
    _calculator().update(consumed_samples, consistency_check, verbose)


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[Sequence[int]],
                                     global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                                     decrease_batch_size_if_needed: bool = False) -> None:
    """Set up the process's calculator (an error if one exists: destroy it first)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise RuntimeError("the number-of-microbatches calculator is already initialized; call "
                           "destroy_num_microbatches_calculator() or reconfigure_num_microbatches_calculator()")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed)


def reconfigure_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[Sequence[int]],
                                            global_batch_size: int, micro_batch_size: int,
                                            data_parallel_size: int,
                                            decrease_batch_size_if_needed: bool = False) -> None:
    """Replace the process's calculator (for evaluation with other batch sizes, say)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed)


def destroy_num_microbatches_calculator() -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


unset_num_microbatches_calculator = destroy_num_microbatches_calculator


def build_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[Sequence[int]],
                                      global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                                      decrease_batch_size_if_needed: bool = False) -> "NumMicroBatchesCalculator":
    for name, value in (("global_batch_size", global_batch_size), ("micro_batch_size", micro_batch_size),
                        ("data_parallel_size", data_parallel_size)):
        check_positive_int(name, value)
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                       decrease_batch_size_if_needed, rank)
        if rank == 0:
            logger.info("setting number of microbatches to constant %d", calculator.get())
        return calculator
    if len(rampup_batch_size) != 3:
        raise ValueError("rampup_batch_size must be [start batch size, batch size increment, ramp-up samples], "
                         f"got {list(rampup_batch_size)}")
    start, increment, samples = (int(v) for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                    decrease_batch_size_if_needed, rank, start, increment, samples)


def _round_down(batch_size: int, divisor: int) -> int:
    return (batch_size // divisor) * divisor


class NumMicroBatchesCalculator:
    def __init__(self, micro_batch_size: int, data_parallel_size: int, decrease_batch_size_if_needed: bool,
                 rank: int):
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.num_micro_batches: Optional[int] = None
        self.current_global_batch_size: Optional[int] = None
        self.current_running_global_batch_size: Optional[int] = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        return self.current_running_global_batch_size

    def _set_batch_size(self, global_batch_size: int, consistency_check: bool) -> None:
        unit = self.micro_batch_times_data_parallel_size
        if consistency_check and not self.decrease_batch_size_if_needed and global_batch_size % unit != 0:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by micro batch size "
                f"{self.micro_batch_size} x data-parallel size {self.data_parallel_size}")
        if self.decrease_batch_size_if_needed and global_batch_size >= unit:
            running = _round_down(global_batch_size, unit)
        else:
            running = global_batch_size
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.num_micro_batches = max(1, running // unit)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        raise NotImplementedError


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """global_batch_size // (micro_batch_size x data_parallel_size) microbatches, always."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int):
        super().__init__(micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank)
        if global_batch_size < self.micro_batch_times_data_parallel_size:
            raise ValueError(f"global batch size {global_batch_size} is smaller than micro batch size "
                             f"{micro_batch_size} x data-parallel size {data_parallel_size}")
        self._set_batch_size(global_batch_size, consistency_check=True)
        if rank == 0 and self.current_running_global_batch_size != global_batch_size:
            logger.info("decreasing batch size from %d to %d to keep it divisible by micro batch size %d x "
                        "data-parallel size %d", global_batch_size, self.current_running_global_batch_size,
                        micro_batch_size, data_parallel_size)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        pass


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Megatron's linear batch-size ramp-up (see the module docstring)."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int, start_global_batch_size: int,
                 batch_size_increment: int, ramup_samples: int):
        super().__init__(micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank)
        if start_global_batch_size < 1 or batch_size_increment < 1 or ramup_samples < 0:
            raise ValueError("rampup_batch_size needs start >= 1, increment >= 1 and ramp-up samples >= 0, got "
                             f"{[start_global_batch_size, batch_size_increment, ramup_samples]}")
        diff = global_batch_size - start_global_batch_size
        if diff < 0 or diff % batch_size_increment != 0:
            raise ValueError(f"rampup_batch_size: global batch size {global_batch_size} minus the start batch "
                             f"size {start_global_batch_size} must be a non-negative multiple of the increment "
                             f"{batch_size_increment}")
        self.global_batch_size = global_batch_size
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        num_increments = diff // batch_size_increment
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments else None
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        previous = self.current_global_batch_size
        if consumed_samples > self.ramup_samples or self.rampup_samples_per_increment is None:
            batch = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            batch = min(self.global_batch_size, self.start_global_batch_size + steps * self.batch_size_increment)
        self._set_batch_size(batch, consistency_check)
        if verbose and self.rank == 0 and previous is not None and previous != batch:
            logger.info("ramping up batch size from %d to %d (%d microbatches)", previous, batch,
                        self.num_micro_batches)
