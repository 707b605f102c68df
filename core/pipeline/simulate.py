"""Run action lists against a cost model without running a model: makespan, bubble, peak
in-flight micro-batches per rank, and deadlock detection (the executor would hang exactly where
the simulator cannot make progress).

Dependencies: forward of (m, stage s) needs forward of (m, s - 1); backward of (m, s) needs
backward of (m, s + 1), and on the last stage its own forward. Communication is free.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.pipeline.schedules import Action


@dataclass
class SimResult:
    makespan: float
    busy: list            # busy time per rank
    peak_in_flight: list  # most forwards not yet matched by their backward, per rank
    timeline: list        # per rank: (start, end, action)

    @property
    def bubble(self) -> float:
        """Idle fraction of ``ranks x makespan``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


class Deadlock(RuntimeError):
    pass


def simulate(schedule: list[list[Action]], fwd_cost=1.0, bwd_cost=2.0) -> SimResult:
    """``fwd_cost`` / ``bwd_cost``: a number, or a list per virtual stage."""
    pp = len(schedule)
    vpp = 1 + max((a.chunk for acts in schedule for a in acts), default=0)
    S = pp * vpp

    def cost(kind, stage):
        c = fwd_cost if kind == "F" else bwd_cost
        return c[stage] if isinstance(c, (list, tuple)) else c

    done: dict = {}  # (kind, m, stage) -> finish time
    pos, clock = [0] * pp, [0.0] * pp
    busy, in_flight, peak = [0.0] * pp, [0] * pp, [0] * pp
    timeline: list = [[] for _ in range(pp)]
    remaining = sum(len(a) for a in schedule)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                s = a.chunk * pp + r
                if a.kind == "F":
                    dep = ("F", a.microbatch, s - 1) if s > 0 else None
                else:
                    dep = ("B", a.microbatch, s + 1) if s < S - 1 else ("F", a.microbatch, s)
                if dep is not None and dep not in done:
                    break
                start = max(clock[r], done.get(dep, 0.0))
                end = start + cost(a.kind, s)
                done[(a.kind, a.microbatch, s)] = end
                timeline[r].append((start, end, a))
                clock[r], busy[r] = end, busy[r] + end - start
                in_flight[r] += 1 if a.kind == "F" else -1
                peak[r] = max(peak[r], in_flight[r])
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: schedule[r][pos[r]] for r in range(pp) if pos[r] < len(schedule[r])}
            raise Deadlock(f"pipeline deadlock: every rank waits ({stuck})")
    return SimResult(max(clock), busy, peak, timeline)


def check_schedule(schedule: list[list[Action]], num_microbatches: int) -> None:
    """Each (micro-batch, chunk) forward and backward exactly once per rank, backward after
    forward, and no deadlock. Raises ``ValueError`` / ``Deadlock``."""
    vpp = 1 + max((a.chunk for acts in schedule for a in acts), default=0)
    for r, acts in enumerate(schedule):
        want = {(k, m, c) for k in "FB" for m in range(num_microbatches) for c in range(vpp)}
        seen = [(a.kind, a.microbatch, a.chunk) for a in acts]
        if sorted(seen) != sorted(want):
            raise ValueError(f"rank {r}: actions are not each F/B of every micro-batch exactly once")
        for i, (k, m, c) in enumerate(seen):
            if k == "B" and ("F", m, c) not in seen[:i]:
                raise ValueError(f"rank {r}: backward of micro-batch {m} chunk {c} before its forward")
    simulate(schedule)


def textbook_bubble(pp: int, m: int, vpp: int = 1) -> float:
    """Idle fraction of (interleaved) 1F1B with equal stages and backward = 2 x forward:
    ``(p - 1) / (v * m + p - 1)``."""
    return (pp - 1) / (vpp * m + pp - 1)


def render_text(result: SimResult, width: int = 100) -> str:
    """One row per rank; a forward of micro-batch m is drawn with the digit/letter ``m``
    (0-9, a-z), its backward with the same symbol upper-cased or, for digits, ``=``-framed."""
    scale = width / result.makespan
    symbols = "0123456789abcdefghijklmnopqrstuvwxyz"
    rows = []
    for r, events in enumerate(result.timeline):
        line = [" "] * width
        for start, end, a in events:
            ch = symbols[a.microbatch % len(symbols)]
            lo, hi = int(start * scale), max(int(end * scale), int(start * scale) + 1)
            cells = [ch] * (hi - lo)
            if a.kind == "B":
                cells = [ch.upper()] * (hi - lo) if ch.isalpha() else ["="] * (hi - lo)
                if not ch.isalpha():
                    cells[len(cells) // 2] = ch
            for x, c in zip(range(lo, hi), cells):
                if x < width:
                    line[x] = c
        rows.append(f"rank {r:>2} |{''.join(line)}|")
    return "\n".join(rows)


def plan_makespan(programs: dict, pp: int, fwd_cost=1.0, bwd_cost=2.0) -> float:
    """Makespan of the executor's programs (``core/pipeline/p2p.plan_all``) under the cost model
    and NCCL's ordering, with transfers themselves free: a rank issues each batch without
    waiting; a batch completes once every batch linked to it by messages is issued and each
    one's predecessor on its rank has completed (NCCL runs a rank's groups in order); an action
    that consumes a message starts after the batch that receives it completes. The gap to
    ``simulate`` (communication free and unordered) is what the plan's ordering costs."""
    from core.pipeline.nccl_replay import linked_batches, pair_batches
    from core.pipeline.p2p import batches_of

    ranks = sorted(programs)
    traces = {r: batches_of(programs[r]) for r in ranks}
    _, linked = pair_batches(traces)
    received = {(r, op.label): b for r in ranks for b, batch in enumerate(traces[r]) for op in batch
                if op.op == "recv"}
    issued, done = {}, {}

    def complete(key):  # completion time, or None while something it needs is not issued yet
        if key in done:
            return done[key]
        group = linked_batches(key, linked) | {key}
        if not all(k in issued for k in group):
            return None
        t = max(issued[k] for k in group)
        for q, b in group:
            prev = complete((q, b - 1)) if b else 0.0
            if prev is None:
                return None
            t = max(t, prev)
        done.update(dict.fromkeys(group, t))
        return t

    def cost(c, kind, stage):
        return c[stage] if isinstance(c, (list, tuple)) else c

    clock, pos, nbatch = dict.fromkeys(ranks, 0.0), dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
    moved = True
    while moved:
        moved = False
        for i, r in enumerate(ranks):
            while pos[r] < len(programs[r]):
                item = programs[r][pos[r]]
                if isinstance(item, list):
                    issued[(r, nbatch[r])] = clock[r]
                    nbatch[r] += 1
                else:
                    s = item.chunk * pp + i
                    b = received.get((r, (item.kind, item.microbatch, s)))
                    if b is not None:
                        t = complete((r, b))
                        if t is None:
                            break
                        clock[r] = max(clock[r], t)
                    clock[r] += cost(fwd_cost if item.kind == "F" else bwd_cost, item.kind, s)
                pos[r] += 1
                moved = True
    if any(pos[r] < len(programs[r]) for r in ranks):
        raise Deadlock("the communication plan cannot complete (see nccl_replay for details)")
    return max(clock.values())
