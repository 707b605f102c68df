"""Plan a run without running it: ``pretrain_step37.py --dry-run N`` and ``tools/plan_memory.py
--world-size N`` are this one code path, over the same parsed training flags, so a training
command pasted into the planner plans exactly that run (defaults agree by construction)."""
from __future__ import annotations

import json

from models.step37.memory_plan import GB, PlanInputs, as_dict, format_table, plan
from train_args import RunLayout


def plan_inputs(args, layout: RunLayout, device_gb: float = 141.0) -> PlanInputs:
    """The planner's view of the training flags."""
    o, m, s = args.optim, args.memory, layout.sizes
    return PlanInputs(pp=s.pp, vpp=s.vpp, ep=s.ep, dp=s.dp, sharding=m.data_parallel_sharding,
                      cpu_offload=m.cpu_offload, fsdp_gather_once=m.fsdp_gather_once,
                      recompute=m.recompute_granularity, recompute_num_layers=m.recompute_num_layers,
                      seq_length=args.data.seq_length, micro_batch_size=args.data.micro_batch_size,
                      num_microbatches=layout.num_microbatches, optimizer=o.optimizer,
                      muon_momentum=o.muon_momentum, dion_rank_fraction=o.dion_rank_fraction,
                      bf16=m.bf16, device_gb=device_gb,
                      pipeline_layout=args.parallel.pipeline_layout)


def every_rank(ranks: list, layout: RunLayout) -> list[dict]:
    """One entry per global rank (ranks that differ only in expert-DP replica plan the same)."""
    by_coords = {(r.pp_rank, r.ep_rank): d for r, d in zip(ranks, as_dict(ranks))}
    out = []
    for rank in range(layout.sizes.world):
        c = layout.sizes.coords(rank)
        out.append({"rank": rank, "dp_rank": c["dp"], "expert_dp_rank": c["expert_dp"],
                    **by_coords[(c["pp"], c["ep"])]})
    return out


def report(args, layout: RunLayout, *, as_json: bool = False, device_gb: float = 141.0,
           prog: str = "plan_memory") -> int:
    """Print the plan of every rank (a table, or JSON with one entry per rank); returns 0."""
    inp = plan_inputs(args, layout, device_gb)
    ranks = plan(layout.config, inp)
    s = layout.sizes
    if as_json:
        print(json.dumps({"world_size": s.world, "inputs": vars(inp), "ranks": every_rank(ranks, layout)},
                         indent=2))
        return 0
    print(f"world {s.world} = pp {s.pp} x dp {s.dp} (ep {s.ep}, expert-dp {s.expert_dp}), "
          f"{layout.num_microbatches} micro-batches per pipeline; nothing allocated")
    print(format_table(ranks, inp))
    if s.expert_dp > 1:
        print(f"(each row stands for its {s.expert_dp} expert-DP replicas; --json lists every rank)")
    worst = max(ranks, key=lambda r: r.device_total)
    fits = all(r.fits for r in ranks)
    print(f"{prog}: {sum(r.parameters for r in ranks if r.ep_rank == 0):,} parameters on EP rank 0's "
          f"pipeline; busiest rank pp{worst.pp_rank} ep{worst.ep_rank} needs "
          f"{worst.device_total / GB:.1f} GB on device, {worst.host_total / GB:.1f} GB on host: "
          f"{'fits' if fits else 'does NOT fit'} {device_gb:g} GB")
    return 0
