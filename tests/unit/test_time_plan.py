"""The step-time model against hand counts on the tiny model, and its direction: more copies
are slower, more bandwidth is faster."""
from __future__ import annotations

import pytest

from models.step37 import Step37Config
from tests.planner_inputs import inputs
from training.planner.inputs import PlanInputs, optim_options
from training.planner.memory import plan
from training.planner.timing import TimeAssumptions, plan_time

TINY = Step37Config.preset("tiny")
# Forward FLOPs per token of the tiny model at seq_length 64 (hidden 64, head_dim 16, 2 KV heads):
#   attention projections (q, k, v, head gate; o) H * (Hq*D + 2*Hkv*D + Hq) + Hq*D*H:
#     full (4 heads) 64*132 + 64*64 = 12,544; sliding (6 heads) 64*166 + 96*64 = 16,768
#   scores and values 2*Hq*D*avg_keys: full 2*4*16*32.5 = 4,160 (causal over 64 tokens);
#     sliding 2*6*16*7.5625 = 1,452 (window 8: (36 + 56*8) / 64 keys per query)
#   attention 2*(proj + core): full 33,408, sliding 36,440
#   dense FFN 2*3*64*96 = 36,864; MoE 2*(64*8 router + 2*3*64*32 top-2 + 3*64*32 shared) = 37,888
#   layers (full+dense, sliding+MoE, sliding+MoE, full+MoE) 70,272 + 74,328 + 74,328 + 71,296
#   head 2*64*320 = 40,960; each MTP depth 2*2*64*64 + 36,440 + 36,864 + 40,960 = 130,648
#   total 290,224 + 40,960 + 2 * 130,648 = 592,480
TINY_FWD_FLOPS_PER_TOKEN = 592_480
TINY_HEAD_FLOPS_PER_TOKEN = 40_960  # 2 * 64 * 320, per head (main and each MTP depth)
TINY_PARAMETERS = 414_592  # every tensor of the model (the memory plan counts them)


def _inputs(**kw) -> PlanInputs:
    base = dict(pp=1, dp=1, seq_length=64, micro_batch_size=1, num_microbatches=2, optimizer="adamw")
    return inputs(**{**base, **kw})


def test_one_rank_step_is_compute_plus_the_optimizer_by_hand():
    """One rank, fp32, AdamW, 2 micro-batches of 64 tokens, at 50% of 1 TFLOP/s:
    compute (3 (forward + backward) x 592,480 + 3 heads x 40,960 that the chunked loss reruns
    in its backward) x 64 tokens x 2 / 0.5e12 = 4.8648192e-4 s; AdamW on the device 28 bytes x
    414,592 parameters / 1 GB/s = 0.011608576 s; nothing else moves (no pipeline, EP, DP or
    offload). MFU counts the model's FLOPs only (3 x forward, no rerun)."""
    a = TimeAssumptions(assumed_mfu=0.5, hbm_gb_s=1.0)
    st = plan_time(TINY, _inputs(), a, peak=1.0)
    assert plan(TINY, _inputs())[0].parameters == TINY_PARAMETERS
    sec = st.ranks[0].seconds
    compute = (3 * TINY_FWD_FLOPS_PER_TOKEN + 3 * TINY_HEAD_FLOPS_PER_TOKEN) * 64 * 2 / 0.5e12
    optimizer = 28 * TINY_PARAMETERS / 1e9
    # sums of a few floats: equal to 1e-12 relative (rounding only)
    assert sec["compute"] == pytest.approx(compute, rel=1e-12) == pytest.approx(4.8648192e-4, rel=1e-12)
    assert sec["optimizer"] == pytest.approx(optimizer, rel=1e-12)
    assert {k: v for k, v in sec.items() if k not in ("compute", "optimizer")} == \
        {"all-to-all": 0.0, "p2p": 0.0, "cp comm": 0.0, "host-device": 0.0, "dp comm": 0.0, "idle": 0.0}
    assert st.step_s == pytest.approx(compute + optimizer, rel=1e-12)
    assert st.tokens_per_s_per_gpu == pytest.approx(2 * 64 / (compute + optimizer), rel=1e-12)
    model_flops = 3 * TINY_FWD_FLOPS_PER_TOKEN * 64 * 2 / 1e12
    assert st.mfu == pytest.approx(model_flops / (compute + optimizer), rel=1e-12)


def test_recompute_reruns_the_layers_and_the_mtp_depths_up_to_their_heads_by_hand():
    """Full recompute of every layer: the backward adds one forward of the 4 layers (290,224)
    and of the 2 MTP depths without their heads (2 x 89,688), besides the 3 heads' rerun;
    selective reruns the depths' layers but not their input projections (2 x 2 x 64 x 128 each)."""
    a = TimeAssumptions(assumed_mfu=0.5, hbm_gb_s=1.0)
    base = plan_time(TINY, _inputs(), a, peak=1.0).ranks[0].seconds["compute"]
    per_token = {"full": 290_224 + 2 * 89_688, "selective": 290_224 + 2 * (89_688 - 2 * 2 * 64 * 64)}
    for mode, extra in per_token.items():
        sec = plan_time(TINY, _inputs(recompute_granularity=mode), a, peak=1.0).ranks[0].seconds
        # a difference of sums of a few floats: rounding only, 1e-9 relative leaves room
        assert sec["compute"] - base == pytest.approx(extra * 64 * 2 / 0.5e12, rel=1e-9), mode


def test_offloaded_shards_cross_pcie_twice_per_microbatch_by_hand():
    """DP 2 with every shard offloaded (fp32, gathered per pass): each micro-batch copies the
    rank's fp32 shards host to device for its forward and again for its backward, the
    synchronising backward sends the gradient shards back once: (2 x 2 + 1) x 4 bytes x S
    shard parameters; AdamW runs on the host over S at --host-gb-s."""
    a = TimeAssumptions(pcie_gb_s=2.0, host_gb_s=4.0, nvlink_gb_s=1e9)
    inp = _inputs(dp=2, data_parallel_sharding="fsdp", cpu_offload="all")
    S = plan(TINY, inp)[0].parameters  # ceil(dim0 / 2) rows of every tensor
    assert TINY_PARAMETERS / 2 <= S < TINY_PARAMETERS / 2 + 1000
    st = plan_time(TINY, inp, a, peak=1.0)
    r = st.ranks[0]
    assert r.bytes["host-device"] == (2 * 2 + 1) * 4 * S
    assert r.seconds["host-device"] == pytest.approx((2 * 2 + 1) * 4 * S / 2e9, rel=1e-12)
    assert r.seconds["optimizer"] == pytest.approx(28 * S / 4e9, rel=1e-12)


def _step(**kw) -> float:
    a = TimeAssumptions(**{k: kw.pop(k) for k in list(kw) if k in ("pcie_gb_s",)})
    return plan_time(TINY, _inputs(dp=2, data_parallel_sharding="fsdp", **kw), a, peak=1.0).step_s


def test_more_offload_copies_are_slower_and_more_bandwidth_is_faster():
    none, experts, all_ = (_step(cpu_offload=m) for m in ("none", "experts", "all"))
    assert none < experts < all_
    assert _step(cpu_offload="all", fsdp_gather_once=True) < all_  # one copy per step, not 2 M
    assert _step(cpu_offload="all", num_microbatches=4) > _step(cpu_offload="all", num_microbatches=2) * 1.5
    assert _step(cpu_offload="all", pcie_gb_s=50.0) < _step(cpu_offload="all", pcie_gb_s=25.0)
    assert _step(cpu_offload="none", pcie_gb_s=50.0) == _step(cpu_offload="none", pcie_gb_s=25.0)


def test_pipeline_idle_and_all_to_all_appear_with_pp_and_ep():
    st = plan_time(TINY, _inputs(pp=2, dp=2, ep=2, num_microbatches=4), peak=1.0)
    assert all(r.seconds["p2p"] > 0 and r.seconds["all-to-all"] > 0 for r in st.ranks)
    assert st.bubble > 0 and st.makespan_s < st.step_s
    # the slowest rank's step: the pipeline's makespan plus its once-per-step work
    slow = st.ranks[st.slowest]
    assert slow.total == pytest.approx(st.makespan_s + slow.seconds["optimizer"] + slow.seconds["dp comm"],
                                       rel=1e-9)


def test_assumptions_are_validated_naming_the_flag():
    with pytest.raises(ValueError, match=r"--assumed-mfu must be in \(0, 1\], got 1.5"):
        TimeAssumptions(assumed_mfu=1.5)
    with pytest.raises(ValueError, match="--pcie-gb-s must be a finite number > 0, got 0"):
        TimeAssumptions(pcie_gb_s=0)
    for bad in (float("nan"), float("inf")):  # inf made every transfer free and was taken
        with pytest.raises(ValueError, match=f"--host-gb-s must be a finite number > 0, got {bad}"):
            TimeAssumptions(host_gb_s=bad)


def test_muon_under_fsdp_counts_the_busiest_owner_not_every_matrix():
    """DP 4 x EP 2 with FSDP (expert-DP 2): a dense matrix is orthogonalised by one owner of the
    four (core/optim/muon_split.py), in batches closed when their FLOPs reach 4 x their largest,
    so the rank's dense Newton-Schulz FLOPs are each batch's busiest owner's, between a quarter of
    the whole and less than the whole; a stack of whole experts is orthogonalised where it is
    (exactly half of the stacks' FLOPs at expert-DP 2); the split's traffic is 3/4 of the rank's
    matrix rows at 2 + 2 bytes (bf16 both ways)."""
    from core.optim.build import classify
    from core.optim.muon_split import batches, ns_flops, owners
    from training.planner.shares import rank_shares
    from training.planner.timing import optimizer_work

    chunk = rank_shares(TINY, 1, 1, 2, None, 64)[0][0]
    matrices = [s for s in chunk.tensors if classify(s.spec, s.t, "muon") == "matrix"]
    dense = [tuple(s.t.shape) for s in matrices if not s.expert]
    experts = [tuple(s.t.shape) for s in matrices if s.expert]
    assert dense and experts and all(len(x) == 2 for x in dense) and all(len(x) == 3 for x in experts)
    work = optimizer_work(chunk, 4, 2, optim_options("muon"))
    busiest = 0.0
    for idx in batches(dense, 4):
        shapes = [dense[j] for j in idx]
        own = owners(shapes, 4)
        busiest += max(sum(ns_flops(x, 5) for x, o in zip(shapes, own) if o == r) for r in range(4))
    whole = sum(ns_flops(x, 5) for x in dense)
    assert work["dense"]["flops"] == pytest.approx(busiest, rel=1e-12)
    assert whole / 4 <= busiest < whole
    assert work["expert"]["flops"] == pytest.approx(sum(ns_flops(x, 5) for x in experts) / 2, rel=1e-12)
    # in the backward the batches follow the hooks' order: still between the bounds
    assert whole / 4 <= optimizer_work(chunk, 4, 2, optim_options("muon"), True)["dense"]["flops"] < whole

    a = TimeAssumptions(assumed_mfu=0.5, hbm_gb_s=1e6, nvlink_gb_s=1.0)
    inp = _inputs(dp=4, ep=2, data_parallel_sharding="fsdp", optimizer="muon", muon_momentum=0.0, num_microbatches=1)
    sec = plan_time(TINY, inp, a, peak=1.0).ranks[0].seconds
    adamw = _inputs(dp=4, ep=2, data_parallel_sharding="fsdp", optimizer="adamw", num_microbatches=1)
    # what Muon adds to the data-parallel traffic over AdamW's (same shards, same reduce-scatter)
    extra = sec["dp comm"] - plan_time(TINY, adamw, a, peak=1.0).ranks[0].seconds["dp comm"]
    assert extra == pytest.approx(3 / 4 * work["dense"]["split"] * 4 / 1e9, rel=1e-9)


def test_the_shared_expert_hides_behind_its_layers_dispatch_by_hand():
    """EP 2, one rank's 64 tokens, 3 MoE layers: each dispatch or combine sends 64 x top-2 x 64
    fp32 x 1/2 = 16,384 bytes; the forward's 6 all-to-alls at 1 GB/s take 98.304 us, less what
    each layer's shared expert (6 x 64 x 32 = 12,288 FLOPs per token, 64 tokens at 50% of
    1 TFLOP/s: 1.572864 us) computes while its dispatch (16.384 us) is in flight; with full
    recompute the backward's rerun hides as much again."""
    a = TimeAssumptions(assumed_mfu=0.5, nvlink_gb_s=1.0)
    shared, dispatch = 12_288 * 64 / 0.5e12, 16_384 / 1e9
    inp = _inputs(dp=2, ep=2, num_microbatches=1, recompute_granularity="full")
    sec = plan_time(TINY, inp, a, peak=1.0).ranks[0].seconds
    # forward 6 and backward 6 + 6 (rerun) all-to-alls; 3 + 3 hidden shared-expert forwards
    assert sec["all-to-all"] == pytest.approx(18 * dispatch - 6 * min(shared, dispatch), rel=1e-9)
    # the all-gather dispatcher runs the shared expert after its collective: nothing hidden
    gather = _inputs(dp=2, ep=2, num_microbatches=1, recompute_granularity="full", moe_dispatcher="allgather")
    assert plan_time(TINY, gather, a, peak=1.0).ranks[0].seconds["all-to-all"] == pytest.approx(18 * dispatch, rel=1e-9)


@pytest.mark.parametrize("nvlink_gb_s", [0.1, 1e6])
def test_in_backward_newton_schulz_fills_the_backwards_all_to_all_waits_by_hand(nvlink_gb_s):
    """--optimizer-in-backward runs Newton-Schulz on a stream of its own (core/optim/
    in_backward.py): it fills the compute stream's waits for the backward's all-to-alls, but only
    with work queued before them. DP 2 x EP 2 with FSDP, full recompute, one micro-batch; the
    backward reaches the MTP depths (dense), layers 3, 2, 1 (MoE) and 0 (dense). Each MoE layer
    waits for its rerun's dispatch and combine (less the shared expert hidden in the dispatch),
    its combine's backward, then (its expert stacks' Newton-Schulz queued) its dispatch's
    backward. Fast links (1e6 GB/s): every one of those 9 waits is filled. Slow links (0.1
    GB/s): everything hides but what is queued after layer 1's dispatch backward: the dense
    batches FSDP's hooks close at layer 1's end, at layer 0 and at the root (muon_split's batches
    in hook order, their busiest owner's FLOPs). Without the flag nothing hides (its split
    batches follow parameter order instead of the hooks', hence the FLOPs of both orders)."""
    from core.optim.build import classify
    from core.optim.muon_split import batches, ns_flops, owners
    from training.planner.shares import rank_shares
    from training.planner.timing import _hook_order, optimizer_work

    eff = 0.5e12
    a = TimeAssumptions(assumed_mfu=0.5, nvlink_gb_s=nvlink_gb_s)
    chunk = rank_shares(TINY, 1, 1, 2, None, 64)[0][0]

    def ns_seconds(in_backward):
        work = optimizer_work(chunk, 2, 1, optim_options("muon"), in_backward)
        return (work["dense"]["flops"] + work["expert"]["flops"]) / eff

    def optimizer_s(in_backward):
        inp = _inputs(dp=2, ep=2, data_parallel_sharding="fsdp", optimizer="muon", muon_momentum=0.0,
                      num_microbatches=1, recompute_granularity="full", optimizer_in_backward=in_backward)
        return plan_time(TINY, inp, a, peak=1.0).ranks[0].seconds["optimizer"]

    if nvlink_gb_s == 1e6:
        hidden = 9 * 16_384 / (nvlink_gb_s * 1e9)
    else:
        dense = [s for s in sorted(chunk.tensors, key=_hook_order)
                 if classify(s.spec, s.t, "muon") == "matrix" and not s.expert]
        late = 0.0
        for idx in batches([tuple(s.t.shape) for s in dense], 2):
            if dense[idx[-1]].block in (1, 0, None):
                shapes = [tuple(dense[j].t.shape) for j in idx]
                own = owners(shapes, 2)
                late += max(sum(ns_flops(x, 5) for x, o in zip(shapes, own) if o == r) for r in range(2)) / eff
        hidden = ns_seconds(True) - late
        assert 0 < late < ns_seconds(True)
    # sums of a few floats: equal to 1e-9 relative to the optimizer's seconds (rounding only)
    assert optimizer_s(True) == pytest.approx(optimizer_s(False) + ns_seconds(True) - ns_seconds(False) - hidden,
                                              rel=1e-9)


def test_cp2_halves_compute_and_moves_kv_over_the_cp_group_by_hand():
    """CP2 on two ranks, the hand count above: compute is each rank's 32 tokens (half of one
    rank's 4.8648192e-4 s, exactly: the causal work splits evenly). K/V rows are 2 KV heads x 16
    x 2 (K and V) x 4 bytes = 256 bytes; a full layer receives the other rank's 32 rows (8,192
    bytes), a sliding one (window 8, chunks of 16) at most the busiest rank's halo of 7 + 7 rows
    (3,584 bytes); 2 full and 4 sliding layers (2 MTP depths) -> 30,720 bytes per forward, as
    many per backward, 2 micro-batches: 122,880 bytes at 150 GB/s = 8.192e-7 s."""
    a = TimeAssumptions(assumed_mfu=0.5, hbm_gb_s=1.0)
    sec = plan_time(TINY, _inputs(cp=2), a, peak=1.0).ranks[0].seconds
    assert sec["compute"] == pytest.approx(4.8648192e-4 / 2, rel=1e-12)
    assert sec["cp comm"] == pytest.approx(122_880 / 150e9, rel=1e-12)
    assert plan_time(TINY, _inputs(), a, peak=1.0).ranks[0].seconds["cp comm"] == 0.0
    full = plan_time(TINY, _inputs(cp=2, recompute_granularity="full"), a, peak=1.0).ranks[0].seconds
    assert full["cp comm"] == pytest.approx(1.5 * 122_880 / 150e9, rel=1e-12)  # the recompute gathers again


def test_muon_batches_close_where_closes_batch_says():
    """``batches`` keeps a running sum and maximum (the planner asks it thousands of times per
    search); over random shape lists its batches are those closed by ``closes_batch`` (what the
    in-backward steps call) on the growing list."""
    import random

    from core.optim.muon_split import batches, closes_batch

    def by_definition(shapes, world):
        out, held = [], []
        for j in range(len(shapes)):
            held.append(j)
            if closes_batch([shapes[i] for i in held], world):
                out, held = out + [held], []
        return out + ([held] if held else [])

    rng = random.Random(0)
    for _ in range(300):
        shapes = [tuple(rng.randint(1, 64) for _ in range(rng.choice((2, 2, 3)))) for _ in range(rng.randint(0, 20))]
        world = rng.randint(1, 8)
        assert batches(shapes, world) == by_definition(shapes, world), (shapes, world)
