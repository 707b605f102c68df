"""Plan a run without running it: ``pretrain_step37.py --dry-run N`` and ``tools/plan_memory.py
--world-size N`` are this one code path, over the same parsed training flags, so a training
command pasted into the planner plans exactly that run (defaults agree by construction): memory
per rank and the predicted step time. ``tools/plan_memory.py --search`` ranks every layout of
the world size with the same two models (``training/planner/search.py``)."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict

from core.memory_mode import MemoryMode
from core.optim.registry import OptimOptions
from models.registry import shapes_of
from training.trace import report as trace
from training.planner.inputs import PlanInputs
from training.planner.memory import GB, as_dict, format_table, plan
from training.planner.timing import BREAKDOWN, StepTime, TimeAssumptions, peak_tflops, plan_time
from training.planner.vision import ImageMix, layout_for
from training.run_layout import RunLayout, model_config

DEFAULT_DEVICE_GB = 141.0  # H200


def check_plannable(args, cfg) -> None:
    """``ValueError`` naming the flag for what a plan would get wrong: a part frozen that the planner
    books as learning (it books a frozen vision tower only), images in the packs of a family whose
    shapes hold no vision tower (its image tokens would be planned as text). ``train_args.validate_plan``
    (``--dry-run``, tools/plan_memory.py) and ``--search`` call it."""
    for part in ("projector", "language"):
        if getattr(args.model, f"freeze_{part}", False):
            raise ValueError(f"--freeze-{part} is not planned (the planner books a frozen vision tower "
                             "only, --freeze-vision); plan without it for an upper bound")
    images = getattr(args, "images", None)
    if images is not None and images.image_token_share and shapes_of(cfg).vision is None:
        raise ValueError(f"--image-token-share {images.image_token_share:g}: this model family has no vision "
                         "tower to plan (its image tokens would be planned as text): leave the flag out, or "
                         "plan a vision-language family")


def plan_inputs(args, layout: RunLayout | None = None, device_gb: float = DEFAULT_DEVICE_GB) -> PlanInputs:
    """The planner's view of the training flags (``layout``: the validated sizes; without it,
    the flags' own pipeline, EP and CP sizes at the fewest DP ranks they allow, for the search to
    replace)."""
    o, m, p = args.optim, args.memory, args.parallel
    if layout is not None:
        s, M = layout.sizes, layout.num_microbatches
        pp, vpp, ep, dp, cp = s.pp, s.vpp, s.ep, s.dp, s.cp
    else:
        pp, vpp, ep, cp = (p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
                           p.expert_model_parallel_size, p.context_parallel_size)
        dp = ep // math.gcd(ep, cp)  # the fewest DP ranks that EP can be carved out of (with CP)
        M = 1
    return PlanInputs(pp=pp, vpp=vpp, ep=ep, dp=dp, cp=cp, mode=MemoryMode.of(m), optim=OptimOptions.of(o.optimizer, o),
                      seq_length=args.data.seq_length, micro_batch_size=args.data.micro_batch_size,
                      num_microbatches=M, device_gb=device_gb, pipeline_layout=p.pipeline_layout,
                      moe_dispatcher=args.model.moe_dispatcher, compile=args.model.compile,
                      overlap_moe_expert_parallel_comm=args.parallel.overlap_moe_expert_parallel_comm,
                      **_lora_fields(args), **_image_fields(args))


def _lora_fields(args) -> dict:
    """The LoRA flags the planner reads (none for a namespace without the section)."""
    lora = getattr(args, "lora", None)
    return dict(lora_rank=lora.lora_rank, lora_targets=lora.lora_targets) if lora is not None else {}


def _image_fields(args) -> dict:
    """The planner's images (``args.images``, an ``ImageMix`` that tools/plan_memory.py attaches;
    none, as under ``--dry-run``: text only, the tower frozen as ``--freeze-vision`` says)."""
    images = getattr(args, "images", None)
    if images is None:
        images = ImageMix(freeze_vision=bool(getattr(args.model, "freeze_vision", False)))
    return asdict(images)


def every_rank(ranks: list, layout: RunLayout) -> list[dict]:
    """One entry per global rank (ranks that differ only in expert-DP replica plan the same)."""
    by_coords = {(r.pp_rank, r.ep_rank): d for r, d in zip(ranks, as_dict(ranks))}
    out = []
    for rank in range(layout.sizes.world):
        c = layout.sizes.coords(rank)
        out.append({"rank": rank, "dp_rank": c["dp"], "cp_rank": c["cp"], "expert_dp_rank": c["expert_dp"],
                    **by_coords[(c["pp"], c["ep"])]})
    return out


def report(args, layout: RunLayout, *, as_json: bool = False, device_gb: float = DEFAULT_DEVICE_GB,
           prog: str = "plan_memory", assumptions: TimeAssumptions | None = None) -> int:
    """Print the plan of every rank (a table, or JSON with one entry per rank) and the predicted
    step time; returns 0."""
    inp = plan_inputs(args, layout, device_gb)
    assumptions = assumptions or getattr(args, "time", None)  # a "time" section of train_args, if any
    ranks = plan(layout.config, inp)
    peak = peak_tflops(args.logging.peak_tflops)
    st = plan_time(layout.config, inp, assumptions, peak, args.data.global_batch_size)
    s = layout.sizes
    try:  # --trace: the real step of the chosen ranks on fake tensors (training/trace/)
        traced = trace.run_traces(args, layout, trace.chosen_ranks(args.memory.trace_ranks, ranks, layout)) \
            if getattr(args.memory, "trace", False) else {}
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if as_json:
        entries = every_rank(ranks, layout)
        trace.add_json(entries, traced)
        print(json.dumps({"world_size": s.world, "inputs": inp.as_json(), "ranks": entries,
                          "time": time_dict(st)}, indent=2))
        return 0
    cp = f" x cp {s.cp}" if s.cp > 1 else ""
    print(f"world {s.world} = pp {s.pp} x dp {s.dp}{cp} (ep {s.ep}, expert-dp {s.expert_dp}), "
          f"{layout.num_microbatches} micro-batches per pipeline; nothing allocated")
    table = format_table(ranks, inp)
    print(trace.add_column(table, ranks, traced, layout) if traced else table)
    chosen = layout_for(layout.config, inp)
    if chosen != inp.pipeline_layout:
        print(f"{prog}: with {inp.image_token_share:g} of the tokens images, planned with --pipeline-layout "
              f"{chosen} (the vision tower's cost on stage 0); pass it to the trainer, whose default split "
              f"counts text only")
    if getattr(layout.config, "vision", None) is not None and not inp.image_token_share:
        print(f"{prog}: a vision-language model planned with text-only packs (no images): the images' "
              "cost is planned by tools/plan_memory.py --image-token-share F")
    if s.expert_dp > 1:
        print(f"(each row stands for its {s.expert_dp} expert-DP replicas; --json lists every rank)")
    worst = max(ranks, key=lambda r: r.device_total)
    fits = all(r.fits for r in ranks)
    print(f"{prog}: {sum(r.parameters for r in ranks if r.ep_rank == 0):,} parameters on EP rank 0's "
          f"pipeline; busiest rank pp{worst.pp_rank} ep{worst.ep_rank} needs "
          f"{worst.device_total / GB:.1f} GB on device, {worst.host_total / GB:.1f} GB on host: "
          f"{'fits' if fits else 'does NOT fit'} {device_gb:g} GB")
    for line in trace.summary(ranks, traced, layout):
        print(f"{prog}: {line}")
    print(format_time(st))
    print(f"{prog}: {summary(st)}")
    return 0


def search_plan(args, world: int, *, device_gb: float = DEFAULT_DEVICE_GB, host_gb: float = 0.0,
                assumptions: TimeAssumptions | None = None, progress: bool = True,
                reserve_gb: float | None = None) -> list:
    """Every layout of ``world`` ranks for these flags, planned and ranked (``search.Row``)."""
    from training.planner.search import search

    base = plan_inputs(args, device_gb=device_gb)
    return search(model_config(args), world, base, args.data.global_batch_size, assumptions or TimeAssumptions(),
                  peak_tflops(args.logging.peak_tflops), host_gb, progress=progress, reserve=reserve_gb)


def search_report(args, world: int, *, device_gb: float = DEFAULT_DEVICE_GB, host_gb: float = 0.0,
                  assumptions: TimeAssumptions | None = None, top: int = 20, as_json: bool = False,
                  prog: str = "plan_memory", reserve_gb: float | None = None) -> int:
    """``--search``: rank every layout of ``world`` ranks for these flags (see search.py)."""
    from training.planner.search import report as print_rows

    a = assumptions or TimeAssumptions()
    rows = search_plan(args, world, device_gb=device_gb, host_gb=host_gb, assumptions=a, reserve_gb=reserve_gb)
    return print_rows(rows, world, device_gb, host_gb, a, peak_tflops(args.logging.peak_tflops), top, as_json, prog,
                      reserve_gb)


# ------------------------------------------------------------- the step time, as printed

def time_dict(st: StepTime) -> dict:
    d = asdict(st)
    for r, x in zip(d["ranks"], st.ranks):
        r["step_s"] = x.total
    return d


def format_time(st: StepTime) -> str:
    a = st.assumptions
    lines = [f"predicted step time in seconds (assumed: {a['assumed_mfu']:.0%} of {st.peak_tflops:g} "
             f"TFLOP/s, PCIe {a['pcie_gb_s']:g} GB/s, NVLink {a['nvlink_gb_s']:g} GB/s, host "
             f"{a['host_gb_s']:g} GB/s; overlapping the backward: host masters' host work, in-backward "
             f"Newton-Schulz behind its all-to-alls)",
             f"{'rank':<6}" + "".join(f"{k:>13}" for k in BREAKDOWN) + f"{'step':>10}{'PCIe GB':>10}"]
    for r in st.ranks:
        lines.append(f"pp{r.pp_rank:<4}" + "".join(f"{r.seconds[k]:>13.2f}" for k in BREAKDOWN)
                     + f"{r.total:>10.2f}{r.bytes['host-device'] / 1e9:>10.0f}")
    return "\n".join(lines)


def summary(st: StepTime) -> str:
    return (f"predicted step {st.step_s:.1f} s (slowest pp{st.slowest}; pipeline idle "
            f"{st.bubble:.1%}), {st.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {st.mfu:.1%}")
