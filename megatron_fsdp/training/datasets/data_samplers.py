"""Megatron-LM's pretraining data loader and samplers (`megatron.training.datasets.data_samplers`).

`MegatronPretrainingSampler` walks the global sample order from `consumed_samples`: each step
takes the next `micro_batch_size x data_parallel_size` samples and gives data-parallel rank r
its `micro_batch_size` slice. A run resumed from a checkpoint's `consumed_train_samples` thus
continues with exactly the samples an uninterrupted run would have used next, and at another
data-parallel size the same global batches are only divided differently between ranks.
"""

from __future__ import annotations

import random
import signal

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_fsdp.datasets.utils import Split


def _data_parallel_rank_and_size():
    from megatron_fsdp import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _global_args():
    try:
        from megatron_fsdp.training.global_vars import get_args
    except ImportError:
        raise RuntimeError("build_pretraining_data_loader needs the training arguments: pass args=..., "
                           "or set them with megatron_fsdp.training.global_vars") from None
    return get_args()


def build_pretraining_data_loader(dataset, consumed_samples: int, args=None):
    """A DataLoader over `dataset` that starts after `consumed_samples` samples (None for no dataset).

    Reads `dataloader_type` ("single", "cyclic" or "external"), `micro_batch_size`,
    `num_workers`, `data_sharding`, `full_validation` (and `eval_micro_batch_size` for
    valid/test) and `seed` from `args` (the global training arguments by default).

    The loader draws the base seed of its worker processes from a generator of its own, seeded
    with `seed`, where torch's DataLoader draws it from the global CPU generator at every
    `iter()`: building the loaders after a checkpoint restored the RNG states, or a cyclic
    loader starting an epoch, would otherwise move the generator CPU dropout draws from, and a
    resumed run would differ from the uninterrupted one.
    """
    if dataset is None:
        return None
    if args is None:
        args = _global_args()
    split = getattr(dataset, "split", getattr(dataset, "index_split", None))
    dataloader_type = getattr(args, "dataloader_type", None) or "single"
    if dataloader_type == "external":
        return dataset
    is_eval = split in (Split.valid, Split.test)
    micro_batch_size = args.micro_batch_size
    if is_eval and getattr(args, "eval_micro_batch_size", None) is not None:
        micro_batch_size = args.eval_micro_batch_size
    dp_rank, dp_size = _data_parallel_rank_and_size()

    if split == Split.valid and getattr(args, "full_validation", False):
        batch_sampler = MegatronFullValidationSampler(len(dataset), dp_rank, dp_size)
    elif dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    elif dataloader_type == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed_samples, micro_batch_size,
                                                         dp_rank, dp_size, getattr(args, "data_sharding", True))
    else:
        raise ValueError(f"--dataloader-type {dataloader_type} is not supported (single, cyclic or external)")
    num_workers = int(getattr(args, "num_workers", 2))
    # NOTE: a generator of the loader's own, never the global one (see the docstring).
    generator = torch.Generator().manual_seed(int(getattr(args, "seed", 1234)))
    return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, num_workers=num_workers,
                                       pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0,
                                       worker_init_fn=ignore_termination_signals if num_workers > 0 else None,
                                       generator=generator)


def ignore_termination_signals(worker_id: int) -> None:
    """A data loader worker's `worker_init_fn`: ignore SIGTERM and SIGINT.

    torchrun and schedulers (SLURM, Kubernetes) signal a rank's whole process
    group, its data loader workers included. A worker that dies of it makes
    the rank fail ("DataLoader worker ... is killed by signal: Terminated")
    before --exit-signal-handler can save. The workers need no signal of
    their own: the DataLoader shuts them down, and their watchdog ends them
    when the rank dies.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _check_layout(micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int) -> None:
    if micro_batch_size <= 0 or data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"bad sampler layout: micro_batch_size={micro_batch_size}, "
                         f"data_parallel_rank={data_parallel_rank}, data_parallel_size={data_parallel_size}")


class MegatronPretrainingSampler:
    """Sequential batches from `consumed_samples` on; rank r gets slice r of each global micro-step."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: the dataset holds {total_samples} samples")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"no samples left to consume: {consumed_samples} consumed of {total_samples} "
                             "(train longer than the dataset? build it with more samples)")
        _check_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self):
        start_idx = self.data_parallel_rank * self.micro_batch_size
        return start_idx, start_idx + self.micro_batch_size

    def __iter__(self):
        start, end = self.get_start_end_idx()
        step = self.micro_batch_times_data_parallel_size
        first = self.consumed_samples
        full_steps = (self.total_samples - first) // step
        for k in range(full_steps):
            base = first + k * step
            yield list(range(base + start, base + end))
        rest = first + full_steps * step
        if rest < self.total_samples and not self.drop_last:
            batch = list(range(rest, self.total_samples))
            yield batch[start:end]


class MegatronFullValidationSampler:
    """One sample per rank per step over the whole validation set (small sets included)."""

    def __init__(self, total_samples: int, data_parallel_rank: int, data_parallel_size: int) -> None:
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: the dataset holds {total_samples} samples")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"bad sampler layout: rank {data_parallel_rank} of {data_parallel_size}")
        self.total_samples = total_samples
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_size = 1

    def __len__(self) -> int:
        return len(range(self.data_parallel_rank, self.total_samples, self.data_parallel_size))

    def __iter__(self):
        for sample_idx in range(self.data_parallel_rank, self.total_samples, self.data_parallel_size):
            yield [sample_idx]


class RandomSeedDataset(Dataset):
    """Reseeds torch, numpy and random before each sample: `seed = idx + base_seed + epoch`."""

    def __init__(self, dataset, seed: int) -> None:
        self.base_seed = seed
        self.curr_seed = seed
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        self.curr_seed = self.base_seed + epoch

    def __getitem__(self, idx):
        seed = idx + self.curr_seed
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        return self.dataset[idx]


class MegatronPretrainingRandomSampler:
    """`--dataloader-type cyclic`: a fresh permutation per epoch (seeded by the epoch number)."""

    def __init__(self, dataset, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, data_sharding: bool) -> None:
        if total_samples <= 0:
            raise ValueError(f"no sample to consume: the dataset holds {total_samples} samples")
        _check_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples < self.micro_batch_times_data_parallel_size:
            raise ValueError(f"the dataset's {total_samples} samples are fewer than one step "
                             f"({self.micro_batch_times_data_parallel_size})")

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self):
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        if current_epoch_samples % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(f"consumed samples {self.consumed_samples} are not a whole number of steps of "
                             f"{self.micro_batch_times_data_parallel_size} samples (was the data-parallel size "
                             "changed? the cyclic loader resumes only at the same micro-batch x DP size)")
        if isinstance(self.dataset, RandomSeedDataset):
            self.dataset.set_epoch(self.epoch)
        g = torch.Generator()
        g.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start_idx = self.data_parallel_rank * bucket_size
            random_idx = torch.randperm(bucket_size, generator=g).tolist()
            idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            idx_range_total = torch.randperm(full_bucket_size, generator=g).tolist()
            idx_range = idx_range_total[current_epoch_samples:][self.data_parallel_rank::self.data_parallel_size]
        batch = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []
