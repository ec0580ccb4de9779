"""Masks and position ids of a left-to-right sample (Megatron's results, computed without a loop)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy
import torch


def _get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                     reset_attention_mask: bool, eod_mask_loss: bool,
                                     create_attention_mask: bool
                                     ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """`(attention_mask [1, s, s] bool with True = masked, loss_mask [s] float, position_ids [s] long)`.

    With `reset_*`, a document starts after each eod token: positions restart at 0 and a token
    attends only to its own document (the eod belongs to the document it ends).
    """
    seq_length = data.numel()
    positions = torch.arange(seq_length, dtype=torch.long, device=data.device)
    is_eod = data == eod_token

    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    # Document of each token: the number of eod tokens strictly before it.
    document = torch.cumsum(is_eod.long(), dim=0) - is_eod.long()
    position_ids = positions
    if reset_position_ids:
        after_eod = torch.where(is_eod, positions + 1, torch.zeros_like(positions))
        start = torch.cummax(after_eod, dim=0).values
        start = torch.cat([start.new_zeros(1), start[:-1]])
        position_ids = positions - start

    attention_mask = None
    if create_attention_mask:
        allowed = torch.tril(torch.ones((seq_length, seq_length), dtype=torch.bool, device=data.device))
        if reset_attention_mask:
            allowed &= document[:, None] == document[None, :]
        attention_mask = (~allowed).unsqueeze(0)
    return attention_mask, loss_mask, position_ids


def document_cu_seqlens(document_lengths: List[int], sequence_length: int, add_extra_token_to_sequence: bool
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's `inter_document_masking` outputs: `cu_seqlens` padded to `sequence_length + 1`
    entries with `sequence_length`, the longest document, and positions restarting per document."""
    lengths = list(document_lengths)
    if add_extra_token_to_sequence:
        lengths[-1] -= 1  # the shared extra token is a label, not an input
        if lengths[-1] == 0:
            lengths.pop()
    shortfall = sequence_length - sum(lengths)
    if shortfall > 0:  # padding joins the last document
        if lengths:
            lengths[-1] += shortfall
        else:
            lengths.append(shortfall)
    cu_seqlens = torch.tensor(numpy.cumsum([0] + lengths), dtype=torch.int32)
    max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), torch.tensor(lengths))
    position_ids = torch.arange(sequence_length, dtype=torch.long) - starts
    padded = torch.full((sequence_length + 1,), sequence_length, dtype=torch.int32)
    padded[:cu_seqlens.numel()] = cu_seqlens
    return padded, max_seqlen, position_ids
