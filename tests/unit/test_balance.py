"""Pipeline stages balanced by cost: the partition is optimal (checked against brute force on
random costs), and for Step-3.7-Flash it takes layers off the last stage, which carries the
head and three MTP depths."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.pipeline.balance import partition
from models.step37 import Step37Config
from core.costs.flops import avg_keys, balanced_layout, stage_flops
from models.registry import shapes_of
from training.parallelize import even_layout


def _stage_costs(costs, counts, first, last):
    out, i = [], 0
    for s, n in enumerate(counts):
        out.append(sum(costs[i:i + n]) + (first if s == 0 else 0) + (last if s == len(counts) - 1 else 0))
        i += n
    return out


def _brute_force(costs, S, first, last):
    L = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, L), S - 1):
        counts = [b - a for a, b in zip((0,) + cuts, cuts + (L,))]
        worst = max(_stage_costs(costs, counts, first, last))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 4),
       st.integers(0, 80), st.integers(0, 80))
def test_partition_minimises_the_slowest_stage(costs, S, first, last):
    if len(costs) < S:
        with pytest.raises(ValueError, match="cannot fill"):
            partition(costs, S, first, last)
        return
    counts = partition(costs, S, first, last)
    assert len(counts) == S and min(counts) >= 1 and sum(counts) == len(costs)
    # integer costs: the maxima are exact sums, so equality is exact
    assert max(_stage_costs(costs, counts, first, last)) == _brute_force(costs, S, first, last)


def test_avg_keys():
    assert avg_keys(4, None) == (1 + 2 + 3 + 4) / 4
    assert avg_keys(6, 2) == (1 + 2 + 2 + 2 + 2 + 2) / 6  # a window of 2 keys counts the query


def test_step37_flash_pp4_takes_layers_off_the_last_stage():
    cfg = Step37Config.preset("step37-flash")
    even, balanced = even_layout(45, 4), balanced_layout(shapes_of(cfg), 4, 8192)
    assert even == [11, 12, 11, 11] and balanced == [14, 14, 14, 3]
    e, b = stage_flops(shapes_of(cfg), even, 8192), stage_flops(shapes_of(cfg), balanced, 8192)
    assert max(e) / min(e) > 1.8  # the last stage does about twice the work of the others
    assert max(b) / min(b) < 1.02 and max(b) < 0.65 * max(e)
