"""Split a stack of layers into contiguous pipeline stages by cost.

The model supplies a cost per layer and what the first and the last stage carry besides their
layers (embedding; final norm, head, multi-token-prediction depths); this finds the split that
minimises the most expensive stage, since the slowest stage sets the pace of every stage.
"""
from __future__ import annotations


def partition(layer_costs: list[float], num_stages: int, first_extra: float = 0.0,
              last_extra: float = 0.0) -> list[int]:
    """Layer counts per stage (each >= 1, summing to ``len(layer_costs)``) minimising the largest
    stage cost; among splits with that maximum, the one with the smallest sum of squared stage
    costs (so the non-critical stages are even too). Exact for the maximum (dynamic programming
    over prefixes, O(stages x layers^2)); ``ValueError`` when there are fewer layers than stages."""
    L, S = len(layer_costs), num_stages
    if L < S:
        raise ValueError(f"{L} layers cannot fill {S} pipeline stages")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holding layers i..j-1
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == S - 1 else 0.0)

    inf = (float("inf"), float("inf"))
    best = [[inf] * (L + 1) for _ in range(S + 1)]  # best[s][j]: first s stages over layers 0..j-1
    cut = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, S + 1):
        for j in range(s, L - (S - s) + 1):
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev == inf:
                    continue
                c = cost(s - 1, i, j)
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[s][j]:
                    best[s][j], cut[s][j] = cand, i
    counts, j = [], L
    for s in range(S, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]
