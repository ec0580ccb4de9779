"""Megatron-Core's top-level enums (`megatron.core.enums`)."""

import enum


class ModelType(enum.Enum):
    """What pretrain() builds: encoder_or_decoder covers GPT and BERT-style models."""

    encoder_or_decoder = 1
