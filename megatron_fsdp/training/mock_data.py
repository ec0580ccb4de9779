"""A learnable synthetic dataset for --mock-data runs.

Each sample walks a fixed random successor table from a random start token,
so the next token is a function of the current one: a model that learns the
table drives the loss toward zero, which makes "the loss goes down" visible in
a few dozen steps. Samples depend only on (seed, index): every rank, layout
and restart sees the same data.
"""

from __future__ import annotations

import torch


class MockGPTDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234):
        if vocab_size < 2 or seq_length < 1:
            raise ValueError(f"need vocab_size >= 2 and seq_length >= 1, got {vocab_size}, {seq_length}")
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        g = torch.Generator().manual_seed(seed)
        self.successor = torch.randperm(vocab_size, generator=g)

    def _start_token(self, index: int) -> int:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return int(torch.randint(0, self.vocab_size, (1,), generator=g))

    def batch(self, indices) -> dict[str, torch.Tensor]:
        """tokens, labels, loss_mask, position_ids, each [len(indices), seq_length]."""
        walk = torch.empty(len(indices), self.seq_length + 1, dtype=torch.long)
        walk[:, 0] = torch.tensor([self._start_token(i) for i in indices], dtype=torch.long)
        for i in range(self.seq_length):
            walk[:, i + 1] = self.successor[walk[:, i]]
        n = len(indices)
        return {
            "tokens": walk[:, :-1],
            "labels": walk[:, 1:],
            "loss_mask": torch.ones(n, self.seq_length),
            "position_ids": torch.arange(self.seq_length).expand(n, -1),
        }
