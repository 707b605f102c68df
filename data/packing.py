"""Pack planning: documents -> fixed-size packs (best-fit decreasing, in C++), cached on disk.

``plan_packs(lengths, seq_length)`` returns a :class:`PackPlan`: pack ``p`` is
``segments[pack_offsets[p]:pack_offsets[p + 1]]``, each row ``(document id, start token,
length)``. Every pack holds at most ``seq_length`` tokens; packs come in a seeded shuffled order
(never length-sorted). Documents longer than ``seq_length`` are split into chunks (default),
truncated or dropped, and what truncation and dropping lose is counted in the plan.

The algorithm and its exact tie-breaking live in ``csrc/pack_planner.cpp``; ``data/
packing_reference.py`` is a slow pure-Python twin that the tests hold it to, byte for byte.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from data import _csrc, cache

LONG_DOC_POLICIES = ("split", "truncate", "drop")
_PLAN_FORMAT = 1  # bump when the planner's output for the same inputs changes


@dataclass
class PackPlan:
    pack_offsets: np.ndarray  # int64 [P + 1]
    segments: np.ndarray      # int64 [N, 3]: document id, start token, length
    seq_length: int
    dropped_tokens: int = 0
    truncated_tokens: int = 0
    dropped_docs: int = 0
    truncated_docs: int = 0
    split_docs: int = 0
    empty_docs: int = 0

    @property
    def num_packs(self) -> int:
        return len(self.pack_offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.segments[:, 2].sum())

    @property
    def fill(self) -> float:
        """Fraction of pack slots that hold a token."""
        return self.num_tokens / (self.num_packs * self.seq_length) if self.num_packs else 0.0

    def pack(self, p: int) -> np.ndarray:
        return self.segments[self.pack_offsets[p]:self.pack_offsets[p + 1]]

    def pack_tokens(self) -> np.ndarray:
        """Tokens in each pack (int64 [P])."""
        return np.add.reduceat(self.segments[:, 2], self.pack_offsets[:-1]) if self.num_packs \
            else np.zeros(0, np.int64)

    def counts(self) -> dict:
        return {k: getattr(self, k) for k in ("dropped_tokens", "truncated_tokens", "dropped_docs",
                                              "truncated_docs", "split_docs", "empty_docs")}


def plan_packs(lengths, seq_length: int, *, long_docs: str = "split", seed: int = 0) -> PackPlan:
    """Best-fit-decreasing pack plan for documents of the given lengths (see module docstring).

    Zero-length documents are skipped and counted (``empty_docs``). Same inputs and seed give a
    byte-identical plan on any machine. Runs in O(n + S) memory and O(n log S) time, without the
    GIL.
    """
    if long_docs not in LONG_DOC_POLICIES:
        raise ValueError(f"long_docs must be one of {', '.join(LONG_DOC_POLICIES)}, got {long_docs!r}")
    if int(seq_length) < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and lengths.dtype.kind not in "iu"):
        raise ValueError(f"lengths must be a 1-D integer array, got {lengths.dtype} "
                         f"with shape {lengths.shape}")
    offsets, segments, stats = _csrc.plan_packs(
        np.ascontiguousarray(lengths, dtype=np.int64), int(seq_length),
        LONG_DOC_POLICIES.index(long_docs), int(seed) % 2**64)
    return PackPlan(offsets, segments, int(seq_length), **stats)


def permutation(n: int, seed: int) -> np.ndarray:
    """A seeded shuffle of ``range(n)`` (int64), identical on every machine (splitmix64)."""
    return _csrc.permutation(int(n), int(seed) % 2**64)


def plan_cache_key(lengths: np.ndarray, seq_length: int, long_docs: str, seed: int) -> str:
    """Hash of everything the plan depends on: the lengths themselves, S, policy, seed, format."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    h.update(json.dumps([seq_length, long_docs, seed, _PLAN_FORMAT]).encode())
    return h.hexdigest()[:20]


def cached_plan(lengths, seq_length: int, cache_prefix: str, *, long_docs: str = "split",
                seed: int = 0, cache_path: str | None = None) -> PackPlan:
    """``plan_packs``, saved as ``.npy`` files and memory-mapped once built.

    Where (``data/cache.py``): in ``cache_path`` when given (``--data-cache-path``), else beside
    ``cache_prefix``, else, when that directory cannot be written, in the user cache. The file
    names carry the hash of the inputs, so a changed dataset, length, policy or seed never
    reuses a stale plan. Writes go to temporary names renamed at the end, the meta file last.
    """
    lengths = np.asarray(lengths)
    key = plan_cache_key(lengths, seq_length, long_docs, seed)
    suffixes = [f"_packplan_{key}_offsets.npy", f"_packplan_{key}_segments.npy",
                f"_packplan_{key}_meta.json"]  # meta last: its presence marks a complete plan
    for base in cache.read_bases(cache_prefix, cache_path):
        if all(os.path.exists(base + s) for s in suffixes):
            with open(base + suffixes[2]) as f:
                meta = json.load(f)
            return PackPlan(np.load(base + suffixes[0], mmap_mode="r"),
                            np.load(base + suffixes[1], mmap_mode="r"), int(seq_length), **meta)
    plan = plan_packs(lengths, seq_length, long_docs=long_docs, seed=seed)
    arrays = {suffixes[0]: plan.pack_offsets, suffixes[1]: plan.segments}

    def write(suffix, f):
        if suffix in arrays:
            np.save(f, arrays[suffix], allow_pickle=False)
        else:
            f.write(json.dumps(plan.counts()).encode())

    cache.save(cache.cache_bases(cache_prefix, cache_path), suffixes, write,
               f"pack plan of {cache_prefix}")
    return plan
