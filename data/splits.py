"""``--split train,valid,test`` as document ranges (no torch: tools that only count tokens use it).

The parts are contiguous: the first documents train (what ``data.loader.open_source(
train_fraction=...)`` keeps, with the same boundary), the next validate, the rest is the test part.
"""
from __future__ import annotations


def split_bounds(num_docs: int, split: str) -> tuple[int, int]:
    """(end of the train part, end of the validation part) in documents, for ``--split``."""
    w = [float(x) for x in split.split(",")]
    train_end = max(1, int(num_docs * w[0] / sum(w)))  # as open_source(train_fraction=...)
    valid_end = num_docs if w[2] == 0 else int(num_docs * (w[0] + w[1]) / sum(w))
    return train_end, min(num_docs, max(train_end, valid_end))
