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
import warnings
import zlib
from dataclasses import dataclass

import numpy as np

from data import _csrc, cache

LONG_DOC_POLICIES = ("split", "truncate", "drop")
_PLAN_FORMAT = 2  # bump when the planner's output or the cache files change (2: sizes and CRCs)


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
    key: str = ""             # hash of the plan's inputs (cached_plan): lengths, S, policy, seed

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
    reuses a stale plan. Writes go to temporary names renamed at the end, the meta file last;
    the meta file records each array file's size and CRC-32, and an entry that does not match
    them (a truncated or zeroed file, an empty meta file) is named in a warning and rebuilt.
    The plan's ``key`` is the hash (the loader's fingerprint uses it).
    """
    lengths = np.asarray(lengths)
    key = plan_cache_key(lengths, seq_length, long_docs, seed)
    suffixes = [f"_packplan_{key}_offsets.npy", f"_packplan_{key}_segments.npy",
                f"_packplan_{key}_meta.json"]  # meta last: its presence marks a complete plan
    for base in cache.read_bases(cache_prefix, cache_path):
        plan = _read_entry(base, suffixes, int(seq_length))
        if plan is not None:
            plan.key = key
            return plan
    plan = plan_packs(lengths, seq_length, long_docs=long_docs, seed=seed)
    plan.key = key
    arrays = {suffixes[0]: plan.pack_offsets, suffixes[1]: plan.segments}
    files: dict = {}

    def write(suffix, f):
        if suffix in arrays:
            out = _Checksummed(f)
            np.save(out, arrays[suffix], allow_pickle=False)
            files[suffix] = {"bytes": out.size, "crc32": out.crc}
        else:
            f.write(json.dumps({**plan.counts(), "files": files}).encode())

    cache.save(cache.cache_bases(cache_prefix, cache_path), suffixes, write,
               f"pack plan of {cache_prefix}")
    return plan


class _Checksummed:
    """A file that counts and checksums what ``np.save`` writes through it."""

    def __init__(self, f):
        self.f, self.size, self.crc = f, 0, 0

    def write(self, b) -> int:
        b = memoryview(b).cast("B")
        self.size += b.nbytes
        self.crc = zlib.crc32(b, self.crc)
        return self.f.write(b)


def _file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def _read_entry(base: str, suffixes: list[str], seq_length: int) -> PackPlan | None:
    """The cached plan under ``base``; None when it is absent, or damaged (with a warning naming
    the file and what is wrong: the caller rebuilds it)."""
    paths = [base + s for s in suffixes]
    if not all(os.path.exists(p) for p in paths):
        return None
    try:
        with open(paths[2], encoding="utf-8") as f:
            meta = json.load(f)
        files = meta.pop("files")
        for path, suffix in zip(paths[:2], suffixes[:2]):
            want = files[suffix]
            size = os.path.getsize(path)
            if size != want["bytes"]:
                raise _Damaged(path, f"{size} bytes, its meta file records {want['bytes']} (truncated?)")
            if _file_crc(path) != want["crc32"]:
                raise _Damaged(path, "its CRC-32 differs from the one its meta file records "
                                     "(overwritten or corrupt)")
        return PackPlan(np.load(paths[0], mmap_mode="r"), np.load(paths[1], mmap_mode="r"),
                        seq_length, **meta)
    except _Damaged as e:
        why = str(e)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:  # JSON, npy header
        why = f"{paths[2]}: unreadable ({type(e).__name__}: {e})"
    warnings.warn(f"damaged pack-plan cache entry: {why}; rebuilding the plan", stacklevel=3)
    return None


class _Damaged(Exception):
    def __init__(self, path: str, why: str):
        super().__init__(f"{path}: {why}")
