"""Fused kernels behind Megatron-Core's fusion flags that are not a layer's own
(megatron.core.fusions): the fused vocabulary-parallel cross entropy."""

from .fused_cross_entropy import fused_vocab_parallel_cross_entropy

__all__ = ["fused_vocab_parallel_cross_entropy"]
