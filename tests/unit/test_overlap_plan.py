"""The planner's model of --overlap-moe-expert-parallel-comm (training/planner/overlap.py): each
all-to-all of one half of the micro-batch exposes what the other half's compute beside it does
not hide, by hand on the tiny model; the all-to-all buffers of both halves;
the search lists both values; the 8 x H200 recipe predicts less exposed all-to-all and a higher
MFU with the flag than without."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest

from models.step37 import Step37Config
from tests.planner_inputs import inputs
from training.planner.inputs import PlanInputs
from training.planner.memory import plan
from training.planner.overlap import FLAG
from training.planner.timing import TimeAssumptions, plan_time

TINY = Step37Config.preset("tiny")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tiny model at seq_length 64 (tests/unit/test_time_plan.py's hand count), FLOPs per token:
# attention full 33,408, sliding 36,440; an MoE layer's router and top-2 experts 2 * (64 * 8 +
# 2 * 3 * 64 * 32) = 25,600, its shared expert 6 * 64 * 32 = 12,288. Blocks in forward order:
# layer 0 full + dense, 1 and 2 sliding + MoE, 3 full + MoE, the two MTP depths sliding + dense.
# 64 tokens at 50% of 1 TFLOP/s: seconds = FLOPs * 64 / 0.5e12.
SEC = 64 / 0.5e12
A_FULL, A_SLIDE, E, S = 33_408 * SEC, 36_440 * SEC, 25_600 * SEC, 12_288 * SEC
X_SLOW = 16_384 / 1e9  # one dispatch at 1 GB/s: 64 tokens x top-2 x 64 x fp32 x (2-1)/2


def _inputs(**kw) -> PlanInputs:
    base = dict(pp=1, dp=2, ep=2, seq_length=64, micro_batch_size=1, num_microbatches=1, optimizer="adamw")
    return inputs(**{**base, **kw})


def _a2a(nvlink_gb_s: float, **kw) -> float:
    a = TimeAssumptions(assumed_mfu=0.5, nvlink_gb_s=nvlink_gb_s)
    return plan_time(TINY, _inputs(**kw), a, peak=1.0).ranks[0].seconds["all-to-all"]


def test_each_all_to_all_exposes_what_the_other_chunks_compute_does_not_hide_by_hand():
    """Slow links (1 GB/s: a dispatch, 16.4 us, outlasts every compute beside it): per MoE layer
    (attention a, experts e, shared s; halves; the block's own schedule, core/moe/overlap.py)
    the forward exposes (x - (a + s)) + (x - e) + (x - e) + (x - s) over 2; the backward (B's
    input gradients 1x the compute, A's input gradients and both chunks' weight gradients 3x:
    core/moe/joined_grads.py) (x - s) + (x - e) for the combine's backward and (x - 3e) +
    (x - (a + 3s)) for the dispatch's, over 2. Layers 1 and 2 attend sliding, 3 full."""
    x = X_SLOW
    fwd = sum(4 * x - (a + S) - E - E - S for a in (A_SLIDE, A_SLIDE, A_FULL)) / 2
    bwd = sum(4 * x - S - E - 3 * E - (a + 3 * S) for a in (A_SLIDE, A_SLIDE, A_FULL)) / 2
    # sums of a few floats: 1e-9 relative (rounding only)
    assert _a2a(1.0, overlap_moe_expert_parallel_comm=True) == pytest.approx(fwd + bwd, rel=1e-9)
    # full recompute: each layer's rerun forward as the forward
    assert _a2a(1.0, overlap_moe_expert_parallel_comm=True, recompute_granularity="full") == \
        pytest.approx(fwd + bwd + fwd, rel=1e-9)
    # the plain schedule: 4 all-to-alls a layer, the shared expert behind the forward's dispatch
    assert _a2a(1.0) == pytest.approx(3 * (4 * x - S), rel=1e-9)
    assert _a2a(1.0, overlap_moe_expert_parallel_comm=True) < _a2a(1.0)


def test_fast_links_hide_every_all_to_all_with_the_overlap_only():
    """At 1e6 GB/s a dispatch (16 ps) is shorter than any half's compute: the overlap hides all;
    the plain schedule still waits for every one but the shared expert's dispatch."""
    x = 16_384 / 1e15
    assert _a2a(1e6, overlap_moe_expert_parallel_comm=True) == 0.0
    assert _a2a(1e6) == pytest.approx(3 * 3 * x, rel=1e-9)


def test_the_overlaps_halves_hold_the_plain_all_to_all_buffers():
    """All-to-all buffers: 2 x T x top_k x hidden x bytes (at most two of a layer's row buffers
    live beyond what it keeps: the rows in flight and those received, each freed at its wait or
    regrouping; core/moe/dispatch.py), with or without the overlap (its two halves hold as many).
    With --recompute-chunks T is the chunk's."""
    for kw, T in (({}, 64), (dict(micro_batch_size=2, recompute_granularity="full", recompute_chunks=2), 64)):
        plain = plan(TINY, _inputs(**kw))[0].device["all-to-all buffers"]
        both = plan(TINY, _inputs(overlap_moe_expert_parallel_comm=True, **kw))[0].device["all-to-all buffers"]
        assert plain == both == 2 * T * 2 * 64 * 4


def test_the_joined_weight_gradients_are_booked_at_their_largest_moment():
    """core/moe/joined_grads.py keeps B's output gradient of each joined op until A's arrives and
    concatenates both chunks' operands for the one GEMM (training/planner/overlap.py). The tiny
    model at 64 tokens, bf16 (b = 2), halves of m = 32 tokens; its largest MoE block (layers 1
    and 2: 6 heads, 2 KV heads, head dim 16, gate; experts and shared expert of 32, top-2):
    FFN, at A's down projection: kept 2 (64 x 32) + 64 x 64 routed (m x top-2 = 64 rows) and
    2 (32 x 32) + 32 x 64 shared = 12,288 elements; the down projection's concatenation
    max(4 x 64 x 32, 2 x 64 x 32 + 4 x 64 x 64) = 20,480 elements: 65,536 bytes. Attention: kept
    32 x (96 + 32 + 32 + 6 + 64) bf16 (q, k, v, gate, o) and 32 x (64 + 64 + 96 + 32) for the
    norms (input, post-attention, q, k): 31,104 bytes; the largest concatenation the q norm's,
    2 x 32 x 96 x (3 x 4 + 2) = 86,016 (q's and o's linears 2 x 32 x 160 x 2 = 20,480):
    117,120 bytes, the larger moment (an upper bound there: A's o projection has released B's
    by then; traced on fake tensors, the q norm's joined GEMM holds 85,984 beside 20,480 kept).
    Booked beside the rest of the backward; none without the flag."""
    plain = plan(TINY, _inputs(bf16=True))[0]
    both = plan(TINY, _inputs(bf16=True, overlap_moe_expert_parallel_comm=True))[0]
    assert plain.device["joined grads"] == 0
    assert both.device["joined grads"] == 117_120
    assert both.device_total - plain.device_total == 117_120
    # the FFN's moment alone where the attention's is smaller: LoRA on the experts only (rank 4)
    # joins their adapters, 64 x 4 and 64 x 32 (64 x 64 for down) kept per projection:
    # 64 x (4 + 32 + 4 + 32 + 4 + 64) = 8,960 elements, the largest concatenation the down B
    # adapter's (4 -> 64) max(4 x 64 x 4, 2 x 64 x 4 + 4 x 64 x 64) = 16,896: 51,712 bytes
    lora = plan(TINY, _inputs(bf16=True, overlap_moe_expert_parallel_comm=True, lora_rank=4,
                              lora_targets="experts"))[0]
    assert lora.device["joined grads"] == 51_712


def test_search_asked_for_the_flag_lists_both_values_under_expert_parallelism():
    """With the flag among the searched flags: the overlapped twin of every fitting EP layout that
    the trainer serves it on (it needs more memory than the plain one and nothing else; selective
    recompute and CP are refused: core.moe.overlap.check_overlap), none without EP, its flags
    ending with the flag; without it, the plain schedule only."""
    from training.planner.search import search

    base = inputs(seq_length=64, optimizer="adamw", device_gb=1.0, overlap_moe_expert_parallel_comm=True)
    a = TimeAssumptions(nvlink_gb_s=1.0)
    rows = search(TINY, 2, base, 4, a, peak=1.0, progress=False)
    twins = [r for r in rows if r.overlap_moe_expert_parallel_comm]
    assert twins and all(r.ep == 2 and r.fits for r in twins)
    layout = lambda r: replace(r, overlap_moe_expert_parallel_comm=False, device_gb=0, step_s=0,
                               tokens_per_s_per_gpu=0, mfu=0, idle=0)
    served = lambda r: r.mode.recompute_granularity != "selective" and r.cp == 1
    plain = [layout(r) for r in rows if not r.overlap_moe_expert_parallel_comm and r.fits and r.ep == 2 and served(r)]
    assert any(not served(r) for r in rows if r.ep == 2)  # the refused ones are there, without a twin
    assert sorted(map(str, map(layout, twins))) == sorted(map(str, plain))
    best = next(r for r in rows if r.ep == 2)  # slow links: the overlap wins
    assert best.overlap_moe_expert_parallel_comm and best.flags().endswith(FLAG)
    assert not any(r.overlap_moe_expert_parallel_comm for r in rows if r.ep == 1)
    plain = search(TINY, 2, replace(base, overlap_moe_expert_parallel_comm=False), 4, a, peak=1.0, progress=False)
    assert len(plain) == len(rows) - len(twins) and not any(r.overlap_moe_expert_parallel_comm for r in plain)


@pytest.mark.parametrize("recipe, device_gb", [("step37_flash_8xh200_thd_sft.sh", 141.0),
                                               ("step37_flash_8xh100_thd_sft.sh", 80.0)])
def test_the_recipes_predict_less_exposed_all_to_all_and_a_higher_mfu_with_the_flag(recipe, device_gb):
    """The one-node Step-3.7-Flash recipes as they run (their flags, the flag among them),
    planned with and without the flag: less exposed all-to-all and a higher MFU with it, both
    fitting."""
    from tests.unit.test_plan_cli import recipe_flags
    from tools.plan_memory import planned
    from training.planner.run import plan_inputs

    flags = recipe_flags("/unused/Step-3.7-Flash", os.path.join(ROOT, "examples", recipe))
    assert FLAG in flags
    flags = [f for f in flags[4:] if f != FLAG]  # the model from its preset, not a config file
    ns, args, a, layout = planned(["--world-size", "8", "--model-preset", "step37-flash", *flags])
    cfg = Step37Config.preset("step37-flash")
    plain = plan_inputs(args, layout, device_gb)
    both = replace(plain, overlap_moe_expert_parallel_comm=True)
    before, after = (plan_time(cfg, x, a, None, args.data.global_batch_size) for x in (plain, both))
    exposed = lambda st: st.ranks[0].seconds["all-to-all"]
    # 0.63 s vs 2.94 s on both (0.57 s before B's backward left the weight gradients to A's,
    # core/moe/joined_grads.py)
    assert exposed(after) < exposed(before) / 4 and after.mfu > before.mfu
    assert all(r.fits for r in plan(cfg, both))
