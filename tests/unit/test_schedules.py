"""Schedules: deadlock-free, each backward after its forward, in-flight within the 1F1B bound,
and the simulated bubble equal to the textbook formula for equal stages."""
from __future__ import annotations

import pytest

from core.parallel_state import ParallelSizes
from core.pipeline.schedules import Action, build_schedule, interleaved_1f1b
from core.pipeline.simulate import Deadlock, check_schedule, simulate, textbook_bubble
from models.step37 import Step37Config
from training.parallelize import even_layout, stage_layers

LAYOUTS = [(1, 1, 3), (2, 1, 1), (2, 1, 5), (4, 1, 8), (8, 1, 3), (2, 2, 4), (4, 2, 8), (8, 3, 32), (4, 3, 4)]


@pytest.mark.parametrize("pp, vpp, m", LAYOUTS)
def test_schedules_are_valid_and_bounded(pp, vpp, m):
    sched = build_schedule(pp, vpp, m)
    check_schedule(sched, m)
    result = simulate(sched)
    for r, peak in enumerate(result.peak_in_flight):
        if vpp == 1:
            assert peak <= min(pp - r, m)  # 1F1B: at most pp - rank micro-batches alive
        else:
            assert peak <= min((pp - r - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)
    # a fraction in [0, 1) (absolute is relative here, and 0 for pp 1) from float64 ops on small
    # integers: measured <= 5.6e-17 off over these layouts; 1e-9 only absorbs rounding
    assert result.bubble == pytest.approx(textbook_bubble(pp, m, vpp), abs=1e-9)


def test_simulator_finds_a_deadlock():
    bad = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(ValueError, match="backward of micro-batch 0 chunk 0 before its forward"):
        check_schedule(bad, 1)
    # rank 0 waits for B1 from rank 1 before it has sent F1; rank 1 waits for that F1: a cycle
    cycle = [[Action("F", 0), Action("B", 1), Action("F", 1), Action("B", 0)],
             [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    with pytest.raises(Deadlock, match="every rank waits"):
        simulate(cycle)


def test_interleaved_needs_a_multiple_of_pp():
    with pytest.raises(ValueError, match="multiple of --pipeline-model-parallel-size"):
        interleaved_1f1b(0, 4, 2, 6)


def test_stage_layers():
    cfg = Step37Config.preset("tiny")  # 4 layers, 2 MTP depths on the last stage
    assert even_layout(45, 4) == [11, 12, 11, 11]  # extra layer mid-pipeline
    assert [list(r) for r in stage_layers(cfg, 2, "1,3")] == [[0], [1, 2, 3]]  # by hand wins
    with pytest.raises(ValueError, match="need 2 positive counts summing to 4"):
        stage_layers(cfg, 2, "2,3")
    with pytest.raises(ValueError, match="4 layers cannot fill 5 pipeline stages"):
        stage_layers(cfg, 5)
