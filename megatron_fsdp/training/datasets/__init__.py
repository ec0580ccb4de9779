"""Training-side data pieces: Megatron-LM's data loader and samplers."""

from megatron_fsdp.training.datasets.data_samplers import (
    MegatronFullValidationSampler,
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    RandomSeedDataset,
    build_pretraining_data_loader,
)

__all__ = ["MegatronFullValidationSampler", "MegatronPretrainingRandomSampler", "MegatronPretrainingSampler",
           "RandomSeedDataset", "build_pretraining_data_loader"]
