"""Rank-side body of the ``--overlap-moe-expert-parallel-comm`` tests: the overlapped schedule
against the plain one in the same layout, the collectives every rank issued, and a resume."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from core.distributed.collectives import CommRecord
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


def _steps(chunks, ps, cfg, steps, first: int = 0, dtype=torch.float32):
    """Losses and grad norms of plain SGD steps ``first..`` (no optimizer state: a resume is the
    parameters and the router biases, what ``state_dict`` holds)."""
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters() if p.requires_grad], lr=0.1)
    s = settings(cfg, aux_loss_coeff=0.01, router_bias_rate=0.01, clip_grad=1.0, dtype=dtype)
    out = []
    for batches in steps[first:]:
        with _CollectiveCounter() as calls:
            m = train_step(chunks, ps, opt, batches[ps.dp_rank], s)
        out.append((m.loss, m.grad_norm, calls["gather"], calls["scatter"]))
    return out


def one_document(b):
    """The micro-batch ``b`` relabelled as one document (its overlapped chunk B is empty)."""
    T = b.tokens.shape[0]
    cu = torch.tensor([0, T], dtype=torch.int32)
    b.packed_seq_params = PackedSeqParams(cu, cu, T, "thd", (0, T), (0, T))
    b.position_ids = torch.arange(T)
    return b


def check_overlap(rank, world, pp, ep, flags=(), loss_tol=1e-6, first_tol=1e-6, one_doc=False, resume=True):
    """Three steps with the flag give the plain schedule's losses and grad norms (``loss_tol``
    relative, ``first_tol`` the first step's loss: fp32 sums over two chunks in another order,
    measured <= 3e-8; see the bf16 case for its own); ``one_doc``: the last DP rank's first
    micro-batch is one document (B empty there, its all-to-alls still matched); ``resume``: check
    the resume too (the acceptance layouts; the others save its two steps); every EP rank issued its
    all-to-alls in the same order (tokens counts differ per rank: its own packs); a run resumed
    from the flagged run's state after step 1 repeats steps 2-3 bitwise."""
    cfg = tiny_config()
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
    assert sum(getattr(b, "overlap_moe", False) for c in over for b in c.modules()) == \
        sum(len(c.moe_layers()) for c in over) > 0
    snapshot = None
    got = []
    for k in range(STEPS):
        got += _steps(over, ps, cfg, steps[k:k + 1], dtype=dtype)
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

    if not resume:
        return dist.barrier()
    resumed = _build(cfg, ps, pp, ep, (*flags, OVERLAP))
    for c, state in zip(resumed, snapshot):
        c.load_state_dict(state)
    again = _steps(resumed, ps, cfg, steps, first=1, dtype=dtype)
    assert [g[:2] for g in again] == [g[:2] for g in got[1:]], f"rank {rank}: resumed {again} vs uninterrupted {got[1:]}"
    dist.barrier()
