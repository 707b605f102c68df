"""Rank-side body of the ``--overlap-moe-expert-parallel-comm`` tests: the overlapped schedule
against the plain one in the same layout, the collectives every rank issued, and a resume."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from core.distributed.collectives import CommRecord
from core.pipeline.nccl_replay import Collective, replay
from core.packed_seq import PackedSeqParams
from core.parallel_state import ParallelSizes, ParallelState
from core.train_step import train_step
from tests.distributed.fsdp_cases import _CollectiveCounter
from tests.distributed.parallel_cases import micro_batches, run_args, settings, tiny_config
from training.parallelize import parallelize

OVERLAP = "--overlap-moe-expert-parallel-comm"
STEPS = 3


def _build(cfg, ps, pp, ep, flags, record=None):
    chunks = parallelize(cfg, ps, run_args(pp, 1, ep, *flags))
    layers = [m for c in chunks for m in c.moe_layers()]
    for i, m in enumerate(layers):  # name each layer's all-to-alls in the record
        m.dispatcher.record, m.dispatcher.tag = record, f"L{i}."
    return chunks


@contextmanager
def _issue_order(order: list):
    """``order`` gets, in the order this rank's host issues them, ``"p2p"`` for each pipeline
    batch (``batch_isend_irecv``) and a :class:`Collective` for each all-to-all (its group's
    global ranks): the expert-parallel token and count exchanges."""
    p2p, a2a = dist.batch_isend_irecv, dist.all_to_all_single

    def batch(ops):
        order.append("p2p")
        return p2p(ops)

    def all_to_all(*args, group=None, **kw):
        order.append(Collective(tuple(dist.get_process_group_ranks(group or dist.group.WORLD)), "all-to-all"))
        return a2a(*args, group=group, **kw)

    dist.batch_isend_irecv, dist.all_to_all_single = batch, all_to_all
    try:
        yield order
    finally:
        dist.batch_isend_irecv, dist.all_to_all_single = p2p, a2a


def _steps(chunks, ps, cfg, steps, first: int = 0, dtype=torch.float32, joint: list | None = None):
    """Losses and grad norms of plain SGD steps ``first..`` (no optimizer state: a resume is the
    parameters and the router biases, what ``state_dict`` holds). ``joint``: gets the steps'
    pipeline batches (the executor's trace) and all-to-alls, in issue order, for the replay."""
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters() if p.requires_grad], lr=0.1)
    s = settings(cfg, aux_loss_coeff=0.01, router_bias_rate=0.01, clip_grad=1.0, dtype=dtype)
    out = []
    for batches in steps[first:]:
        with _CollectiveCounter() as calls, _issue_order([]) as order:
            m = train_step(chunks, ps, opt, batches[ps.dp_rank], s)
        out.append((m.loss, m.grad_norm, calls["gather"], calls["scatter"]))
        if joint is not None:
            p2p = iter(m.p2p_trace)
            joint += [next(p2p) if o == "p2p" else [o] for o in order]
            assert next(p2p, None) is None
    return out


def one_document(b):
    """The micro-batch ``b`` relabelled as one document (its overlapped chunk B is empty)."""
    T = b.tokens.shape[0]
    cu = torch.tensor([0, T], dtype=torch.int32)
    b.packed_seq_params = PackedSeqParams(cu, cu, T, "thd", (0, T), (0, T))
    b.position_ids = torch.arange(T)
    return b


def check_overlap(rank, world, pp, ep, flags=(), loss_tol=1e-6, first_tol=1e-6, one_doc=False, resume=True,
                  family="step37"):
    """Three steps with the flag give the plain schedule's losses and grad norms (``loss_tol``
    relative, ``first_tol`` the first step's loss: fp32 sums over two chunks in another order,
    measured <= 3e-8; see the bf16 case for its own); ``one_doc``: the last DP rank's first
    micro-batch is one document (B empty there, its all-to-alls still matched); ``resume``: check
    the resume too (the acceptance layouts; the others save its two steps); every EP rank issued its
    all-to-alls in the same order (tokens counts differ per rank: its own packs); a run resumed
    from the flagged run's state after step 1 repeats steps 2-3 bitwise (in memory, plain SGD; through
    checkpoint files with the real optimizer: tests/distributed/test_storage_modes.py); ``family``:
    the tiny model's (glm4_moe: an MoE MTP depth, whose block is overlapped too)."""
    cfg = tiny_config(family)
    sizes = ParallelSizes(world, pp=pp, ep=ep)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    M = max(2, pp)
    packs = int(flags[flags.index("--micro-batch-size") + 1]) if "--micro-batch-size" in flags else 1
    steps = [micro_batches(sizes.dp, M, cfg.vocab_size, seed=s, packs=packs) for s in range(STEPS)]
    if one_doc:
        one_document(steps[0][-1][0])
    dtype = torch.bfloat16 if "--bf16" in flags else torch.float32
    plain = _steps(_build(cfg, ps, pp, ep, flags), ps, cfg, steps, dtype=dtype)

    record = CommRecord()
    over = _build(cfg, ps, pp, ep, (*flags, OVERLAP), record)
    overlapped = [n for c in over for n, b in c.named_modules() if getattr(b, "overlap_moe", False)]
    assert len(overlapped) == sum(len(c.moe_layers()) for c in over) > 0, overlapped
    if family == "glm4_moe" and ps.pp_rank == pp - 1:  # its MTP depth's MoE block (on the last stage)
        assert any(n.startswith("mtp.") for n in overlapped), overlapped
    snapshot = None
    got, joint = [], []
    for k in range(STEPS):
        got += _steps(over, ps, cfg, steps[k:k + 1], dtype=dtype, joint=joint)
        if k == 0:
            snapshot = [{n: t.detach().clone() for n, t in c.state_dict().items()} for c in over]
    # FSDP: the experts unit (and the fp32 router) gather once per forward for both chunks, and the
    # experts gather and reduce once per backward; the router, run twice, gathers once more per
    # micro-batch in the backward and reduce-scatters once more when gradients sync (the last one)
    routers = sum(isinstance(m.router, FSDPModule) and m.router.weight.device_mesh.size() > 1
                  for c in over for m in c.moe_layers())
    for step, ((a, na, ga, sa), (b, nb, gb, sb)) in enumerate(zip(plain, got)):
        print(f"[overlap] step {step}: loss {a!r} vs {b!r}, grad norm {na!r} vs {nb!r}, FSDP all-gathers "
              f"{ga} vs {gb}, reduce-scatters {sa} vs {sb}")
        assert (gb, sb) == (ga + routers * M, sa + routers), (step, (ga, sa), (gb, sb), routers)
        tol = first_tol if step == 0 else loss_tol
        assert abs(a - b) <= tol * abs(a), f"rank {rank} step {step}: loss {b!r} vs plain {a!r}"
        assert abs(na - nb) <= loss_tol * abs(na), f"rank {rank} step {step}: grad norm {nb!r} vs {na!r}"

    # no deadlock: each EP group's ranks issued the same collectives in the same order
    events = [None] * world
    dist.all_gather_object(events, (tuple(ps.ranks("ep")), record.events))
    mine = [ev for key, ev in events if key == tuple(ps.ranks("ep"))]
    assert len(mine) == ep and all(ev == mine[0] for ev in mine), f"rank {rank}: EP ranks issued different orders"
    assert any(w == "grad.start" for _, w in record.events)
    # ... and the pipeline's batches with them: every rank's sequence of both, in issue order,
    # replayed under NCCL's rules with all communicators on one queue (core/pipeline/nccl_replay.py)
    traces = [None] * world
    dist.all_gather_object(traces, joint)
    result = replay(dict(enumerate(traces)))
    assert pp == 1 or any(b[0].op != "collective" for b in joint), "no pipeline batch recorded"
    print(f"[overlap] NCCL replay: {result.batches} batches, {result.operations} operations")

    if not resume:
        return dist.barrier()
    resumed = _build(cfg, ps, pp, ep, (*flags, OVERLAP))
    for c, state in zip(resumed, snapshot):
        c.load_state_dict(state)
    again = _steps(resumed, ps, cfg, steps, first=1, dtype=dtype)
    assert [g[:2] for g in again] == [g[:2] for g in got[1:]], f"rank {rank}: resumed {again} vs uninterrupted {got[1:]}"
    dist.barrier()


def check_gpu_part(rank, world):
    """``tools/gpu_check.sh``'s part j (``benchmarks/gpu_parts/moe_overlap.py``) at its tiny size
    on these ranks: its rank body (the all-to-all bandwidth, both schedules through
    ``bench_moe_overlap.measure``) and its report (the planner's prediction at the measured rates,
    the ``compare`` rows); only its launcher (two spawned ranks) is left to ``--tiny`` by hand."""
    import pytest

    from benchmarks.gpu_parts import common, moe_overlap

    args = common.parse("", ["--tiny"], moe_overlap._extra)
    moe_overlap.sizes(args)
    mine = moe_overlap.rank_result(rank, world, args, cuda=False)
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    r = moe_overlap.report(ranks, args, cuda=False)
    assert r["passed"] and r["syncs"] == [] and r["sizes"] == moe_overlap.TINY, r
    m, p = r["measured"], r["planned"]
    assert m["plain"]["mib"] == m["overlap"]["mib"] > 0  # the same bytes both ways
    # the planner's rates are this run's: its bandwidth, and the plain step's compute
    assert p["assumed_gb_s"] == pytest.approx(min(x["bytes_per_s"] for x in ranks) / 1e9)
    compute = m["plain"]["step"] - m["plain"]["exposed"] - m["plain"]["counts"]
    assert p["plain"]["compute"] == pytest.approx(max(compute, 1e-3 * m["plain"]["step"]))
    assert p["overlap"]["compute"] == pytest.approx(p["plain"]["compute"])
    assert 0 <= p["overlap"]["exposed"] < p["plain"]["exposed"]
    assert [c["what"] for c in r["compare"]] == [f"EP2 over gloo, {n}: {k}" for n in ("plain", "overlap") for k in (
        "step", "exposed all-to-all")] + ["EP2 over gloo: all-to-all hidden by the overlap"]
    print(f"[gpu part j] {r['headline']}")
    dist.barrier()
