"""Slow, obvious twins of the C++ pack planner, for tests and for reading.

``plan_packs_reference`` follows ``csrc/pack_planner.cpp`` step by step (same order, same tie
breaks, same PRNG), so its output must equal the native plan byte for byte.
``first_fit_decreasing`` is the textbook baseline the planner is compared with.
"""
from __future__ import annotations

import bisect

import numpy as np

_MASK = 2**64 - 1


class SplitMix64:
    def __init__(self, seed: int):
        self.state = seed & _MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def bounded(self, n: int) -> int:
        """Uniform in [0, n): Lemire's multiply-shift with rejection."""
        m = self.next() * n
        if (m & _MASK) < n:
            threshold = (2**64 - n) % n
            while (m & _MASK) < threshold:
                m = self.next() * n
        return m >> 64


def _pieces(length: int, S: int, policy: str) -> tuple[list[tuple[int, int]], int]:
    """(full S-token chunks as (start, S), residual length that goes through best fit)."""
    if length <= 0:
        return [], 0
    if length == S:
        return [(0, S)], 0
    if length < S:
        return [], length
    if policy == "split":
        return [(c * S, S) for c in range(length // S)], length % S
    return ([(0, S)] if policy == "truncate" else []), 0


def plan_packs_reference(lengths, S: int, long_docs: str = "split", seed: int = 0):
    """(pack_offsets, segments) exactly as the native planner computes them."""
    lengths = [int(x) for x in lengths]
    items = [(d, _pieces(L, S, long_docs)[1]) for d, L in enumerate(lengths)]
    items = sorted([it for it in items if it[1] > 0], key=lambda it: -it[1])  # stable
    stacks: dict[int, list[int]] = {}  # remaining capacity -> packs, last pushed on top
    caps: list[int] = []               # sorted capacities with a non-empty stack
    bfd_packs: list[list[tuple[int, int, int]]] = []
    for d, r in items:
        k = bisect.bisect_left(caps, r)
        if k == len(caps):
            p, remaining = len(bfd_packs), S - r
            bfd_packs.append([])
        else:
            cap = caps[k]
            p = stacks[cap].pop()
            if not stacks[cap]:
                caps.pop(k)
            remaining = cap - r
        bfd_packs[p].append((d, lengths[d] - r if lengths[d] > S else 0, r))
        if remaining > 0:
            if not stacks.get(remaining):
                stacks[remaining] = []
                bisect.insort(caps, remaining)
            stacks[remaining].append(p)
    packs = bfd_packs + [[(d, start, n)] for d, L in enumerate(lengths)
                         for start, n in _pieces(L, S, long_docs)[0]]
    perm = list(range(len(packs)))
    rng = SplitMix64(seed)
    for i in range(len(perm) - 1, 0, -1):
        j = rng.bounded(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    ordered = [packs[p] for p in perm]
    offsets = np.zeros(len(ordered) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in ordered], out=offsets[1:])
    segments = np.array([s for p in ordered for s in p], dtype=np.int64).reshape(-1, 3)
    return offsets, segments


def first_fit_decreasing(lengths, S: int) -> int:
    """Number of packs first-fit decreasing needs for documents of length <= S."""
    free: list[int] = []
    for L in sorted((int(x) for x in lengths if x > 0), reverse=True):
        for i, f in enumerate(free):
            if f >= L:
                free[i] -= L
                break
        else:
            free.append(S - L)
    return len(free)
