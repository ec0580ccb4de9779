"""Index builders that Megatron-Core implements in C++ (`helpers.cpp`, compiled with `make` at
run time there), here in numpy and Python with the same results, element for element.

- `build_sample_idx`: where each GPT sample starts, as (document-index position, token offset);
  numpy-vectorized (a searchsorted over the cumulative document lengths).
- `build_blending_indices`: Megatron's greedy blend ("pick the dataset whose sample count lags
  its weight the most"), including its floating-point tie-breaking (the lowest dataset wins a
  tie). A speculative numpy pass predicts a block of picks and verifies them exactly; where the
  prediction keeps failing it falls back to the plain loop.
- `build_exhaustive_blending_indices`: the same greedy with integer sizes, drawing each
  dataset exactly `sizes[i]` times.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Sequence

import numpy

from megatron_fsdp.datasets.utils import log_single_rank

logger = logging.getLogger(__name__)

_PROGRESS_EVERY_S = 10.0
# Samples per pass of build_sample_idx: small enough that the temporaries are reused from the heap
# rather than mapped afresh (and page-faulted in) each pass. 1 << 24 took 1.3 s for the 12M samples
# of the mock corpus at sequence length 16 in a new process, 1 << 16 0.23 s.
_SAMPLE_CHUNK = 1 << 16


def build_sample_idx(sizes: numpy.ndarray, document_indices: numpy.ndarray, sequence_length: int,
                     num_epochs: int, tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                     add_extra_token_to_sequence: bool = True) -> numpy.ndarray:
    """The `[num_samples + 1, 2]` sample index: row i is (position in `document_indices`, offset).

    Sample i covers the flattened token stream from position `i * sequence_length` to
    `(i + 1) * sequence_length` (plus one shared token with `add_extra_token_to_sequence`).
    Megatron's C++ walks documents one by one; a row is the document holding the sample's
    last token and the offset of that token, so a binary search over the cumulative
    document lengths gives the same rows at once.
    """
    if sequence_length < 2 or num_epochs < 1 or tokens_per_epoch < 2:
        raise ValueError(f"build_sample_idx needs sequence_length > 1, num_epochs > 0 and tokens_per_epoch > 1, "
                         f"got {sequence_length}, {num_epochs}, {tokens_per_epoch}")
    extra = 1 if add_extra_token_to_sequence else 0
    total = num_epochs * tokens_per_epoch
    if drop_last_partial_sequence:
        num_samples = (total - extra) // sequence_length
    else:
        # Megatron computes this ceil in single precision; keep its count for large corpora.
        num_samples = int(numpy.ceil(numpy.float32(total - extra) / numpy.float32(sequence_length)))
    sample_idx_max = max(document_indices.shape[0], int(sizes.max()) if sizes.size else 0)
    dtype = numpy.int32 if sample_idx_max <= numpy.iinfo(numpy.int32).max else numpy.int64

    doc_lengths = sizes[document_indices].astype(numpy.int64)
    starts = numpy.zeros(len(doc_lengths) + 1, dtype=numpy.int64)
    numpy.cumsum(doc_lengths, out=starts[1:])
    if starts[-1] != total:
        raise ValueError(f"build_sample_idx: the documents hold {starts[-1]} tokens, "
                         f"num_epochs x tokens_per_epoch is {total}")

    sample_idx = numpy.empty((num_samples + 1, 2), dtype=dtype)
    sample_idx[0] = 0
    n_complete = min(num_samples, (total - extra) // sequence_length)
    # With the shared extra token a row is the document holding the sample's last token (empty
    # documents are skipped); without it, the document holding the token before the boundary
    # (so the offset may equal that document's length).
    side = "right" if extra else "left"
    for first in range(1, n_complete + 1, _SAMPLE_CHUNK):  # bounded temporaries on huge corpora
        ends = numpy.arange(first, min(first + _SAMPLE_CHUNK, n_complete + 1), dtype=numpy.int64) * sequence_length
        doc = numpy.searchsorted(starts, ends, side=side) - 1
        sample_idx[first:first + len(ends), 0] = doc
        sample_idx[first:first + len(ends), 1] = ends - starts[doc]
    # A partial last sample (drop_last_partial_sequence=False) ends at the end of the last document.
    last = len(document_indices) - 1
    sample_idx[n_complete + 1:, 0] = last
    sample_idx[n_complete + 1:, 1] = int(sizes[document_indices[last]]) - extra
    return sample_idx


def _progress(total: int, what: str) -> Callable[[int], None]:
    start = time.monotonic()
    state = {"next": start + _PROGRESS_EVERY_S}

    def report(done: int) -> None:
        now = time.monotonic()
        if now >= state["next"]:
            state["next"] = now + _PROGRESS_EVERY_S
            log_single_rank(logger, logging.INFO, f"> {what}: {done}/{total} ({100.0 * done / total:.1f}%, "
                                                   f"{now - start:.0f} s)")
    return report


def _greedy_loop(weights: List[float], counts: List[int], s_begin: int, s_end: int,
                 out_dataset: numpy.ndarray, out_sample: numpy.ndarray) -> None:
    """Megatron's loop, verbatim in arithmetic: error_i = w_i * max(s, 1) - count_i, first max wins."""
    n = len(weights)
    picks = [0] * (s_end - s_begin)
    samples = [0] * (s_end - s_begin)
    if n == 2:
        w0, w1 = weights
        c0, c1 = counts
        for j, s in enumerate(range(s_begin, s_end)):
            x = float(s) if s > 1 else 1.0
            if w1 * x - c1 > w0 * x - c0:
                picks[j] = 1
                samples[j] = c1
                c1 += 1
            else:
                samples[j] = c0
                c0 += 1
        counts[0], counts[1] = c0, c1
    else:
        for j, s in enumerate(range(s_begin, s_end)):
            x = float(s) if s > 1 else 1.0
            best, best_error = 0, weights[0] * x - counts[0]
            for i in range(1, n):
                error = weights[i] * x - counts[i]
                if error > best_error:
                    best, best_error = i, error
            picks[j] = best
            samples[j] = counts[best]
            counts[best] += 1
    out_dataset[s_begin:s_end] = picks
    out_sample[s_begin:s_end] = samples


def _predict(weights: numpy.ndarray, counts: numpy.ndarray, length: int) -> numpy.ndarray:
    """A guess of the next `length` picks: each dataset's next picks merged by due time k / w_i."""
    n = len(weights)
    keys, ids = [], []
    for i in range(n):
        k = counts[i] + numpy.arange(int(length * weights[i]) + 2, dtype=numpy.float64)
        keys.append(k / weights[i])
        ids.append(numpy.full(len(k), i, dtype=numpy.int64))
    keys, ids = numpy.concatenate(keys), numpy.concatenate(ids)
    order = numpy.argsort(keys, kind="stable")
    guess = ids[order][:length]
    if len(guess) < length:  # never for normalized weights; keep the shape regardless
        guess = numpy.concatenate([guess, numpy.zeros(length - len(guess), dtype=numpy.int64)])
    return guess


def _verify(weights: numpy.ndarray, counts: numpy.ndarray, s0: int, guess: numpy.ndarray):
    """The exact picks over a block given that `guess` was followed; returns (#correct, pick at mismatch)."""
    n = len(weights)
    steps = numpy.maximum(numpy.arange(s0, s0 + len(guess), dtype=numpy.float64), 1.0)
    onehot = guess[None, :] == numpy.arange(n)[:, None]
    before = counts[:, None] + numpy.cumsum(onehot, axis=1) - onehot
    exact = numpy.argmax(weights[:, None] * steps[None, :] - before.astype(numpy.float64), axis=0)
    wrong = numpy.flatnonzero(exact != guess)
    if len(wrong) == 0:
        return len(guess), None
    return int(wrong[0]), int(exact[wrong[0]])


def build_blending_indices(dataset_index: numpy.ndarray, dataset_sample_index: numpy.ndarray,
                           weights: Sequence[float], num_datasets: int, size: int, verbose: bool = False) -> None:
    """Fill `dataset_index[:size]` (int16) and `dataset_sample_index[:size]` (int64) in place."""
    w = numpy.asarray(weights, dtype=numpy.float64)
    if len(w) != num_datasets:
        raise ValueError(f"build_blending_indices: {len(w)} weights for {num_datasets} datasets")
    counts = numpy.zeros(num_datasets, dtype=numpy.int64)
    report = _progress(size, "blending indices")
    s, block = 0, 4096
    # Speculation pays off when the greedy follows the due-time merge for long stretches
    # (always for two datasets, for equal weights); otherwise the loop is cheaper.
    speculate = num_datasets > 1
    while s < size:
        report(s)
        if not speculate:
            end = min(size, s + (1 << 20))
            state = counts.tolist()
            _greedy_loop(w.tolist(), state, s, end, dataset_index, dataset_sample_index)
            counts[:] = state
            s = end
            continue
        length = min(block, size - s)
        guess = _predict(w, counts, length)
        good, fix = _verify(w, counts, s, guess)
        if fix is not None:
            guess = guess[:good + 1]
            guess[good] = fix
        taken = len(guess)
        onehot = guess[None, :] == numpy.arange(num_datasets)[:, None]
        before = counts[:, None] + numpy.cumsum(onehot, axis=1) - onehot
        dataset_index[s:s + taken] = guess
        dataset_sample_index[s:s + taken] = before[guess, numpy.arange(taken)]
        counts += onehot.sum(axis=1)
        s += taken
        if fix is None:
            block = min(block * 2, 1 << 18)
        elif taken < 1024:
            # A verification pass costs about as much as ~500 loop steps.
            speculate = False
    if verbose:
        for i in range(num_datasets):
            log_single_rank(logger, logging.INFO,
                            f"   dataset {i}, input: {w[i]}, achieved: {counts[i] / max(size, 1)}")


def build_exhaustive_blending_indices(dataset_index: numpy.ndarray, dataset_sample_index: numpy.ndarray,
                                      sizes: Sequence[int], num_datasets: int) -> None:
    """Draw exactly `sizes[i]` samples from dataset i, interleaved by the same greedy rule."""
    sizes = [int(x) for x in sizes]
    total = sum(sizes)
    weights = [x / float(total) for x in sizes]
    counts = [0] * num_datasets
    unspent = [i for i in range(num_datasets) if sizes[i] > 0]
    report = _progress(total, "exhaustive blending indices")
    picks = numpy.empty(total, dtype=numpy.int16)
    samples = numpy.empty(total, dtype=numpy.int64)
    for s in range(total):
        if s % 65536 == 0:
            report(s)
        x = float(s) if s > 1 else 1.0
        best, best_error = -1, -numpy.finfo(numpy.float64).max
        for i in unspent:
            error = weights[i] * x - counts[i]
            if error > best_error:
                best, best_error = i, error
        picks[s] = best
        samples[s] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    dataset_index[:total] = picks
    dataset_sample_index[:total] = samples
