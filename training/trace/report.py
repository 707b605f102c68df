"""``--trace`` in the planner's output: which ranks to trace, a progress bar while they run, the
"traced" column of the table and the ``traced_*`` fields of ``--json``."""
from __future__ import annotations

import sys

from training.trace.runner import TraceResult, trace_rank

GB = 10**9


def chosen_ranks(flag: str | None, planned: list, layout) -> list[int]:
    """``--trace-ranks`` as global ranks, else the first global rank of the planner's busiest
    (pipeline, EP) coordinates; ``ValueError`` naming the flag."""
    world = layout.sizes.world
    if flag:
        try:
            ranks = [int(x) for x in flag.split(",")]
        except ValueError:
            raise ValueError(f"--trace-ranks {flag!r}: give comma-separated rank numbers, e.g. 0,7") from None
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ValueError(f"--trace-ranks {flag}: rank {bad[0]} is not in a world of {world} (0..{world - 1})")
        return list(dict.fromkeys(ranks))
    worst = max(planned, key=lambda r: r.device_total)
    for rank in range(world):
        c = layout.sizes.coords(rank)
        if (c["pp"], c["ep"]) == (worst.pp_rank, worst.ep_rank):
            return [rank]
    return [0]


def run_traces(args, layout, ranks: list[int], progress: bool = True) -> dict[int, TraceResult]:
    """Trace each rank in turn, a progress bar on stderr (three stages a rank)."""
    from tqdm import tqdm

    out = {}
    with tqdm(total=3 * len(ranks), desc="trace", unit="stage", file=sys.stderr, disable=not progress) as bar:
        for rank in ranks:
            def tick(what, rank=rank):
                if bar.n < bar.total and what != "build and parallelize":
                    bar.update(1)
                bar.set_postfix_str(f"rank {rank}: {what}")
            out[rank] = trace_rank(args, layout, rank, progress=tick)
            bar.update(1)
    return out


def coords(layout, rank: int) -> tuple[int, int]:
    c = layout.sizes.coords(rank)
    return c["pp"], c["ep"]


def add_column(table: str, planned: list, traced: dict, layout) -> str:
    """The planner's table with a "traced" device column (GB) on the rows of traced ranks."""
    by_row = {coords(layout, r): t for r, t in traced.items()}
    lines = table.split("\n")
    head = next(i for i, line in enumerate(lines) if line.startswith("rank"))
    lines[head] += f"{'traced':>10}"
    for i, r in enumerate(planned):
        t = by_row.get((r.pp_rank, r.ep_rank))
        lines[head + 1 + i] += f"{t.device_total / GB:>10.1f}" if t is not None else f"{'-':>10}"
    return "\n".join(lines)


def summary(planned: list, traced: dict, layout) -> list[str]:
    """One line per traced rank: the traced peak beside the planned one, and its columns."""
    plan = {(r.pp_rank, r.ep_rank): r for r in planned}
    out = []
    for rank, t in traced.items():
        p = plan[coords(layout, rank)]
        diff = (t.device_total - p.device_total) / p.device_total if p.device_total else 0.0
        cols = ", ".join(f"{k} {v / GB:.1f}" for k, v in t.device.items() if v)
        out.append(f"traced rank {rank} (pp{p.pp_rank} ep{p.ep_rank}): device peak {t.device_total / GB:.1f} GB "
                   f"({diff:+.1%} against the plan's {p.device_total / GB:.1f}; at the peak: {cols}), host "
                   f"{t.host_total / GB:.1f} GB; traced in {t.seconds:.0f} s")
        if t.overfreed:
            out.append(f"traced rank {rank}: NOT A BOUND: {t.overfreed / GB:.1f} GB were freed (FSDP storage resizes) "
                       "that the trace never saw allocated, so the peak may be short by up to that much; "
                       "see docs/memory.md, \"The Traced Peak\"")
    return out


def add_json(entries: list[dict], traced: dict) -> None:
    """``traced_device_total``, ``traced_device`` and ``traced_host_total`` on each traced rank's entry."""
    for e in entries:
        t = traced.get(e["rank"])
        if t is not None:
            e.update({k: v for k, v in t.as_json().items() if k != "rank"})
