#!/usr/bin/env python3
"""Simulate a pipeline schedule without running a model: bubble, peak in-flight micro-batches
per rank, a deadlock check, whether its point-to-point plan is safe under NCCL's rules, and a
drawing of the timeline.

    python tools/pipeline_sim.py --pp 8 --vpp 3 --microbatches 32 [--fwd-cost 1 --bwd-cost 2]
        [--stage-costs 1.2,1,1,...] [--plot schedule.png]
    python tools/pipeline_sim.py --pp 4 --microbatches 32 --model-preset step37-flash \
        --seq-length 8192 [--pipeline-layout 14,14,14,3]

The action lists are the ones the executor runs (core/pipeline/schedules.py). Costs are per
virtual stage (forward; backward = bwd/fwd ratio times it). With a model, the costs are its
forward FLOPs per token per stage (core/costs/flops.py over the registered family's block shapes)
and the trainer's default layout
(or --pipeline-layout) is compared side by side with the even split: per-stage work and each
rank's idle fraction, bubble included.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.pipeline.nccl_replay import NCCLDeadlock, P2PMismatch, replay  # noqa: E402
from models.registry import preset_names  # noqa: E402
from core.pipeline.p2p import batches_of, plan_all  # noqa: E402
from core.pipeline.schedules import build_schedule  # noqa: E402
from core.pipeline.simulate import (Deadlock, check_schedule, plan_makespan, render_text,  # noqa: E402
                                    simulate, textbook_bubble)


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


def _idle(result) -> list[float]:
    return [1.0 - b / result.makespan for b in result.busy]


def compare_layouts(sched, args) -> int:
    """The model's stages, even split vs the trainer's layout: work per stage and idle per rank."""
    from core.costs.flops import stage_flops
    from models.registry import resolve, shapes_of
    from training.parallelize import even_layout, stage_layers

    S = args.pp * args.vpp
    try:
        cfg = resolve(args.model_preset, args.hf_config)[1]
        chosen = [len(r) for r in stage_layers(cfg, S, args.pipeline_layout, args.seq_length)]
        even = even_layout(cfg.num_layers, S)
    except ValueError as e:
        print(f"pipeline_sim: error: {e}", file=sys.stderr)
        return 1
    ratio = args.bwd_cost / args.fwd_cost
    runs = {}
    for name, counts in (("even", even), ("default" if not args.pipeline_layout else "given", chosen)):
        work = [f / 1e9 for f in stage_flops(shapes_of(cfg), counts, args.seq_length)]
        runs[name] = (counts, work, simulate(sched, work, [w * ratio for w in work]))
    (n1, (c1, w1, r1)), (n2, (c2, w2, r2)) = runs.items()
    i1, i2 = _idle(r1), _idle(r2)
    print(f"{cfg.num_layers} layers over {args.pp} ranks x {args.vpp} virtual, {args.microbatches} "
          f"micro-batches, seq {args.seq_length}; work = forward GFLOP per token (backward {ratio:g}x)")
    print(f"{'stage':>5}{'rank':>5} | {n1 + ' layers':>13}{'work':>8}{'idle':>8} | {n2 + ' layers':>16}"
          f"{'work':>8}{'idle':>8}")
    for s in range(S):
        r = s % args.pp
        print(f"{s:>5}{r:>5} | {c1[s]:>13}{w1[s]:>8.2f}{100 * i1[r]:>7.1f}% | {c2[s]:>16}{w2[s]:>8.2f}"
              f"{100 * i2[r]:>7.1f}%")
    print(f"step time (makespan, GFLOP-units per token): {n1} {r1.makespan:.1f}, {n2} {r2.makespan:.1f} "
          f"({100 * (1 - r2.makespan / r1.makespan):.1f}% less); mean idle {n1} {100 * r1.bubble:.1f}%, "
          f"{n2} {100 * r2.bubble:.1f}% (textbook bubble with equal stages "
          f"{100 * textbook_bubble(args.pp, args.microbatches, args.vpp):.1f}%)")
    print(f"pipeline_sim: {n2} layout {','.join(map(str, c2))}: slowest stage {max(w2):.2f} vs "
          f"{max(w1):.2f} GFLOP/token ({n1} {','.join(map(str, c1))}); NCCL-safe")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    ap.add_argument("--vpp", type=int, default=1, help="virtual stages per rank (default 1)")
    ap.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    ap.add_argument("--fwd-cost", type=float, default=1.0, help="forward time of a stage (default 1)")
    ap.add_argument("--bwd-cost", type=float, default=2.0, help="backward time of a stage (default 2)")
    ap.add_argument("--stage-costs", help="comma-separated forward cost per virtual stage "
                                          "(overrides --fwd-cost; backward scales with it)")
    ap.add_argument("--model-preset", help="cost the stages of this model (a preset of any registered "
                                           f"family: {', '.join(preset_names())})")
    ap.add_argument("--hf-config", help="or of the model of this Hugging Face config.json")
    ap.add_argument("--seq-length", type=int, default=8192, help="tokens per pack, for attention costs")
    ap.add_argument("--pipeline-layout", help="layers per virtual stage (default: the trainer's)")
    ap.add_argument("--width", type=int, default=100, help="characters of the text timeline")
    ap.add_argument("--plot", metavar="PNG", help="also draw the timeline (matplotlib)")
    args = ap.parse_args(argv)
    try:
        sched = build_schedule(args.pp, args.vpp, args.microbatches)
        check_schedule(sched, args.microbatches)
        programs = plan_all(sched)
        comm = replay({r: batches_of(p) for r, p in programs.items()})
    except (ValueError, Deadlock, NCCLDeadlock, P2PMismatch) as e:
        print(f"pipeline_sim: error: {e}", file=sys.stderr)
        return 1
    if args.model_preset or args.hf_config:
        return compare_layouts(sched, args)
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
    print("idle per rank (bubble and imbalance): " + ", ".join(f"{100 * x:.1f}%" for x in _idle(result)))
    print(f"point-to-point plan: NCCL-safe ({comm.batches} batch_isend_irecv groups, "
          f"{comm.operations} operations replayed in issue order, tags ignored: no deadlock, "
          "every message paired with itself)")
    print(f"makespan {result.makespan:.1f}, bubble {100 * result.bubble:.2f}% "
          f"(textbook (p-1)/(v*m+p-1) = {100 * textbook_bubble(args.pp, args.microbatches, args.vpp):.2f}%)")
    timed = plan_makespan(programs, args.pp, fwd, bwd)
    print(f"with the executor's communication order (NCCL runs each rank's batches in order): makespan "
          f"{timed:.1f} ({100 * (timed / result.makespan - 1):+.1f}%)")
    if args.plot:
        plot(result, args.pp, args.plot)
        print(f"plot written to {args.plot}")
    print(f"pipeline_sim: pp {args.pp}, vpp {args.vpp}, {args.microbatches} micro-batches: "
          f"no deadlock, NCCL-safe, bubble {100 * result.bubble:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
