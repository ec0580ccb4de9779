"""Plain re-statements of Megatron-Core's GPT sampling, for tests: loops written the way
Megatron's C++ (helpers.cpp) and Python read, sharing no code with megatron_fsdp.datasets."""

import numpy as np
import torch


def corpus(seed, num_docs, vocab, eod, max_sequences=3, max_len=30):
    """Documents as lists of sequences (token lists); most sequences end with eod."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        doc = []
        for _ in range(int(rng.integers(1, max_sequences + 1))):
            seq = rng.integers(0, vocab - 1, size=int(rng.integers(1, max_len))).tolist()
            if rng.random() < 0.7:
                seq[-1] = eod
            doc.append(seq)
        docs.append(doc)
    return docs


def write(prefix, docs, dtype=np.uint16):
    from megatron_fsdp.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for seq in doc:
            b.add_item(torch.tensor(seq))
        b.end_document()
    b.finalize(prefix + ".idx")


def sample_index_walk(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra):
    """helpers.cpp build_sample_idx, step by step."""
    if drop_last:
        num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    else:
        num_samples = int(np.ceil(np.float32(num_epochs * tokens_per_epoch - extra) / np.float32(seq_length)))
    out = [(0, 0)]
    d, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            length = sizes[doc_idx[d]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - extra
                remaining = 0
            else:
                if d == len(doc_idx) - 1:
                    offset = sizes[doc_idx[d]] - extra
                    break
                d += 1
                offset = 0
        out.append((d, offset))
    return np.array(out, dtype=np.int64)


def gpt_samples(sequences, split_indices, num_samples, seq_length, seed, eod, *, reset_position_ids=False,
                reset_attention_mask=False, eod_mask_loss=False, extra=True, drop_last=True, pad=-1):
    """Every sample of Megatron's GPTDataset for one split, in order, as dicts of tensors."""
    sizes = [len(s) for s in sequences]
    tokens_per_epoch = sum(sizes[i] for i in split_indices)
    extra = int(extra)
    num_epochs = 1
    if num_samples is not None:
        while num_epochs * tokens_per_epoch < num_samples * seq_length + extra:
            num_epochs += 1
    separate = False
    if num_epochs > 1:
        sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
        per_epoch = (tokens_per_epoch - extra) // seq_length
        separate = num_samples - sans_final < int(0.8 * per_epoch)
    rs = np.random.RandomState(seed)

    def shuffled_docs(epochs):
        d = np.array(list(split_indices) * epochs, dtype=np.int32)
        rs.shuffle(d)
        return d

    if separate:
        doc_idx = np.concatenate([shuffled_docs(num_epochs - 1), shuffled_docs(1)])
    else:
        doc_idx = shuffled_docs(num_epochs)
    sample_idx = sample_index_walk(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, extra)
    total = len(sample_idx) - 1
    first = np.arange(sans_final if separate else total, dtype=np.uint32)
    rs.shuffle(first)
    if separate:
        last = np.arange(sans_final, total, dtype=np.uint32)
        rs.shuffle(last)
        first = np.concatenate([first, last])
    out = []
    for j in range(total):
        i = first[j]
        (d0, o0), (d1, o1) = sample_idx[i], sample_idx[i + 1]
        if d0 == d1:
            text = sequences[doc_idx[d0]][o0:o1 + extra]
        else:
            text = list(sequences[doc_idx[d0]][o0:])
            for d in range(d0 + 1, d1):
                text += sequences[doc_idx[d]]
            text += sequences[doc_idx[d1]][:o1 + extra]
        text = list(text) + [pad] * (seq_length + extra - len(text))
        out.append(_sample(text, seq_length, extra, eod, reset_position_ids, reset_attention_mask, eod_mask_loss, pad))
    return out


def _sample(text, seq_length, extra, eod, reset_position_ids, reset_attention_mask, eod_mask_loss, pad):
    if extra:
        tokens, labels = text[:-1], text[1:]
    else:
        tokens, labels = text, text[1:] + [pad]
    s = len(tokens)
    mask = [[1.0 if k <= q else 0.0 for k in range(s)] for q in range(s)]
    loss_mask = [0.0 if (eod_mask_loss and t == eod) else 1.0 for t in tokens]
    positions = list(range(s))
    prev = 0
    for i in [j for j, t in enumerate(tokens) if t == eod]:
        if reset_attention_mask:
            for q in range(i + 1, s):
                for k in range(i + 1):
                    mask[q][k] = 0.0
        if reset_position_ids:
            for q in range(i + 1, s):
                positions[q] -= i + 1 - prev
            prev = i + 1
    loss_mask = [0.0 if lab == pad else m for lab, m in zip(labels, loss_mask)]
    return {
        "tokens": torch.tensor([0 if t == pad else t for t in tokens]),
        "labels": torch.tensor([0 if t == pad else t for t in labels]),
        "attention_mask": torch.tensor(mask).unsqueeze(0) < 0.5,
        "loss_mask": torch.tensor(loss_mask),
        "position_ids": torch.tensor(positions),
    }
