"""Unigram statistics of a dataset: the baseline a language model's loss must beat.

A model that knows only how often each token occurs predicts every token with its frequency; its
loss, in nats per token, is the unigram entropy ``H = -sum_t p_t ln p_t`` of the tokens. A
validation loss below ``H`` says the model uses the context before a token, which is what
training is for. Counting is one pass over the documents' tokens, a block at a time (bounded
memory on any dataset).
"""
from __future__ import annotations

import numpy as np

from data.indexed_dataset import IndexedDataset

BLOCK = 1 << 24  # tokens per bincount


def token_counts(prefix: str, first: int = 0, end: int | None = None) -> np.ndarray:
    """How often each token id occurs in documents ``[first, end)`` of the dataset ``prefix``."""
    ds = IndexedDataset(prefix)
    end = len(ds) if end is None else end
    if end <= first:
        return np.zeros(0, np.int64)
    lo = int(ds.pointers[first]) // ds.dtype.itemsize  # the documents are contiguous in the .bin
    hi = int(ds.pointers[end - 1]) // ds.dtype.itemsize + int(ds.lengths[end - 1])
    counts = np.zeros(0, np.int64)
    for a in range(lo, hi, BLOCK):
        block = np.bincount(np.asarray(ds._bin[a:min(hi, a + BLOCK)], dtype=np.int64))
        if len(block) > len(counts):
            block[:len(counts)] += counts
            counts = block
        else:
            counts[:len(block)] += block
    return counts


def entropy(counts: np.ndarray) -> float:
    """The entropy in nats of the distribution ``counts / counts.sum()`` (0 for no tokens)."""
    total = int(counts.sum())
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def unigram_entropy(prefix: str, first: int = 0, end: int | None = None) -> tuple[float, int]:
    """(unigram entropy in nats per token, tokens counted) of documents ``[first, end)``."""
    counts = token_counts(prefix, first, end)
    return entropy(counts), int(counts.sum())

