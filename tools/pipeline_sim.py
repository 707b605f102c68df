#!/usr/bin/env python3
"""Simulate a pipeline schedule without running a model: bubble, peak in-flight micro-batches
per rank, a deadlock check, whether its point-to-point plan is safe under NCCL's rules, and a
drawing of the timeline.

    python tools/pipeline_sim.py --pp 8 --vpp 3 --microbatches 32 [--fwd-cost 1 --bwd-cost 2]
        [--stage-costs 1.2,1,1,...] [--plot schedule.png]

The action lists are the ones the executor runs (core/pipeline/schedules.py). Costs are per
virtual stage (forward; backward = bwd/fwd ratio times it).
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.pipeline.nccl_replay import NCCLDeadlock, P2PMismatch, replay  # noqa: E402
from core.pipeline.p2p import batches_of, plan_all  # noqa: E402
from core.pipeline.schedules import build_schedule  # noqa: E402
from core.pipeline.simulate import Deadlock, check_schedule, render_text, simulate, textbook_bubble  # noqa: E402


def plot(result, pp: int, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.5 * pp + 1.5))
    for r, events in enumerate(result.timeline):
        for start, end, a in events:
            color = "tab:blue" if a.kind == "F" else "tab:orange"
            ax.barh(r, end - start, left=start, color=color, edgecolor="white", linewidth=0.5)
            ax.text((start + end) / 2, r, str(a.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1 unit)")
    ax.set_title(f"bubble {100 * result.bubble:.1f}%  (blue: forward, orange: backward)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    ap.add_argument("--vpp", type=int, default=1, help="virtual stages per rank (default 1)")
    ap.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    ap.add_argument("--fwd-cost", type=float, default=1.0, help="forward time of a stage (default 1)")
    ap.add_argument("--bwd-cost", type=float, default=2.0, help="backward time of a stage (default 2)")
    ap.add_argument("--stage-costs", help="comma-separated forward cost per virtual stage "
                                          "(overrides --fwd-cost; backward scales with it)")
    ap.add_argument("--width", type=int, default=100, help="characters of the text timeline")
    ap.add_argument("--plot", metavar="PNG", help="also draw the timeline (matplotlib)")
    args = ap.parse_args(argv)
    try:
        sched = build_schedule(args.pp, args.vpp, args.microbatches)
        check_schedule(sched, args.microbatches)
        comm = replay({r: batches_of(p) for r, p in plan_all(sched).items()})
    except (ValueError, Deadlock, NCCLDeadlock, P2PMismatch) as e:
        print(f"pipeline_sim: error: {e}", file=sys.stderr)
        return 1
    fwd = args.fwd_cost
    if args.stage_costs:
        fwd = [float(x) for x in args.stage_costs.split(",")]
        if len(fwd) != args.pp * args.vpp:
            print(f"pipeline_sim: error: --stage-costs needs {args.pp * args.vpp} values", file=sys.stderr)
            return 1
    bwd = [c * args.bwd_cost / args.fwd_cost for c in fwd] if isinstance(fwd, list) else args.bwd_cost
    result = simulate(sched, fwd, bwd)
    print(render_text(result, args.width))
    print(f"peak in-flight micro-batches per rank: {result.peak_in_flight}")
    print(f"point-to-point plan: NCCL-safe ({comm.batches} batch_isend_irecv groups, "
          f"{comm.operations} operations replayed in issue order, tags ignored: no deadlock, "
          "every message paired with itself)")
    print(f"makespan {result.makespan:.1f}, bubble {100 * result.bubble:.2f}% "
          f"(textbook (p-1)/(v*m+p-1) = {100 * textbook_bubble(args.pp, args.microbatches, args.vpp):.2f}%)")
    if args.plot:
        plot(result, args.pp, args.plot)
        print(f"plot written to {args.plot}")
    print(f"pipeline_sim: pp {args.pp}, vpp {args.vpp}, {args.microbatches} micro-batches: "
          f"no deadlock, NCCL-safe, bubble {100 * result.bubble:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
