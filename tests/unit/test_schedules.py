"""Schedules: deadlock-free, each backward after its forward, in-flight within the 1F1B bound,
and the simulated bubble equal to the textbook formula for equal stages."""
from __future__ import annotations

import pytest

from core.parallel_state import ParallelSizes
from core.pipeline.schedules import Action, build_schedule, interleaved_1f1b
from core.pipeline.simulate import Deadlock, check_schedule, simulate, textbook_bubble
from models.step37.parallelize import stage_layers

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
    assert [len(r) for r in stage_layers(45, 4)] == [11, 12, 11, 11]  # extra layer mid-pipeline
    assert [list(r) for r in stage_layers(5, 2, "2,3")] == [[0, 1], [2, 3, 4]]
    with pytest.raises(ValueError, match="need 2 positive counts summing to 5"):
        stage_layers(5, 2, "2,2")


@pytest.mark.parametrize("kw, msg", [
    (dict(world=6, pp=4), "not divisible by tp\\*cp\\*pp = 4"),
    (dict(world=8, pp=2, ep=3), "--expert-model-parallel-size 3 must divide the data-parallel size 4"),
    (dict(world=2, vpp=2), "needs --pipeline-model-parallel-size > 1"),
])
def test_layout_errors_name_the_flag(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelSizes(**kw).validate()


def test_layout_errors_for_model_shape():
    with pytest.raises(ValueError, match="4 layers cannot fill pp 4 x virtual stages 2"):
        ParallelSizes(8, pp=4, vpp=2).validate(num_layers=4)
    with pytest.raises(ValueError, match="288 experts do not split over --expert-model-parallel-size 7"):
        ParallelSizes(14, ep=7).validate(num_experts=288)


def test_rank_layout_order():
    """tp-cp-ep-dp-pp, leftmost fastest: with dp=4 (ep=2) and pp=2 ranks 0-3 are stage 0."""
    s = ParallelSizes(8, pp=2, ep=2)
    assert s.coords(5) == {"tp": 0, "cp": 0, "dp": 1, "ep": 1, "expert_dp": 0, "pp": 1}
    groups = s.group_ranks()
    assert [0, 1] in groups["ep"] and [0, 2] in groups["expert_dp"] and [0, 4] in groups["pp"]
    assert [0, 1, 2, 3] in groups["dp"] and [1, 5] in groups["embedding"]


def test_sent_stage_output_is_freed_and_backward_still_exact():
    import torch

    from core.pipeline.executor import _free_values

    x = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    out = x @ w + x  # a stage ends with a residual add
    g = torch.randn(6, 4)
    ref = torch.autograd.grad(out, (x, w), g, retain_graph=True)
    _free_values(out)
    assert out.numel() == 1  # the [T, hidden] values are gone
    torch.autograd.Variable._execution_engine.run_backward((out,), (g,), False, False, (), True, True)
    assert torch.equal(x.grad, ref[0]) and torch.equal(w.grad, ref[1])
    kept = torch.sigmoid(x)  # an op whose backward needs its output: left alone
    _free_values(kept)
    assert kept.shape == (6, 4)
