"""Word (+ learned position, + token type) embeddings, Megatron's [s, b, h] layout."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .... import parallel_state
from ....tensor_parallel import random as tp_random
from ....tensor_parallel.layers import VocabParallelEmbedding
from ....tensor_parallel.mappings import scatter_to_sequence_parallel_region
from ....tensor_parallel.utils import init_full_tensor, record_init
from ....utils import transpose_first_two

_POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")


def _replicated_embedding(num: int, dim: int, config) -> nn.Embedding:
    """An nn.Embedding whose table is the same on every TP rank."""
    full = init_full_tensor((num, dim), config.init_method, config)
    device = full.device if full.device.type == "meta" else parallel_state.get_device()
    weight = nn.Parameter(full.to(device=device, dtype=config.params_dtype, copy=True))
    embedding = nn.Embedding(num, dim, _weight=weight)
    record_init(embedding, "weight", config.init_method, config)
    return embedding


class LanguageModelEmbedding(nn.Module):
    def __init__(self, config, vocab_size: int, max_sequence_length: int,
                 position_embedding_type: str = "learned_absolute", num_tokentypes: int = 0,
                 scatter_to_sequence_parallel: bool = True, tp_group=None):
        super().__init__()
        if position_embedding_type not in _POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type must be one of {_POSITION_EMBEDDING_TYPES}, "
                f"got {position_embedding_type!r}"
            )
        self.config = config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.add_position_embedding = position_embedding_type == "learned_absolute"
        self.num_tokentypes = num_tokentypes
        self.scatter_to_sequence_parallel = scatter_to_sequence_parallel
        # Without additive embeddings after the lookup, the vocab-parallel sum
        # and the sequence-parallel split fuse into one reduce-scatter.
        self.reduce_scatter_embeddings = (
            not self.add_position_embedding and num_tokentypes <= 0
            and config.sequence_parallel and scatter_to_sequence_parallel
        )
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size, config.hidden_size, init_method=config.init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings, config=config, tp_group=tp_group)
        if self.add_position_embedding:
            self.position_embeddings = _replicated_embedding(max_sequence_length, config.hidden_size, config)
        if num_tokentypes > 0:
            self.tokentype_embeddings = _replicated_embedding(num_tokentypes, config.hidden_size, config)
        else:
            self.tokentype_embeddings = None
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s] ids -> [s, b, h] (or [s/tp, b, h] under sequence parallelism)."""
        embeddings = self.word_embeddings(input_ids)
        if self.add_position_embedding:
            if position_ids is None:
                raise ValueError("position_ids are required with learned_absolute position embeddings")
            if input_ids.size(1) > self.max_sequence_length:
                raise ValueError(
                    f"sequence length {input_ids.size(1)} exceeds max_sequence_length "
                    f"{self.max_sequence_length}"
                )
            embeddings = embeddings + self.position_embeddings(position_ids)
        if not self.reduce_scatter_embeddings:
            embeddings = transpose_first_two(embeddings)
        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids given but the embedding was built with num_tokentypes=0")
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids).permute(1, 0, 2)
        elif self.tokentype_embeddings is not None:
            raise ValueError(f"tokentype_ids are required: num_tokentypes={self.num_tokentypes}")

        rng = contextlib.nullcontext()
        if self.config.sequence_parallel:
            if not self.reduce_scatter_embeddings and self.scatter_to_sequence_parallel:
                embeddings = scatter_to_sequence_parallel_region(embeddings)
                if self.config.clone_scatter_output_in_embedding:
                    embeddings = embeddings.clone()
            rng = tp_random.get_cuda_rng_tracker().fork()
        with rng:
            return self.embedding_dropout(embeddings)
