"""Replay recorded point-to-point operations under NCCL's rules, to prove on CPU what gloo
cannot show (gloo buffers sends and honours tags; NCCL does neither).

The rules: each rank's batches run in order (NCCL runs a communicator's groups in issue
order on its stream, whether or not the host waits on them); every operation may block until
matched (a large send does). The strict rule (default) assumes nothing about progress inside a
group (one ``batch_isend_irecv``): batches linked by their messages, directly or through other
batches, complete together, and only while all of them are posted at once. ``strict=False``
lets each operation complete as soon as its partner is posted (NCCL progresses a group's
operations to different peers independently in practice, but does not promise it). The k-th send from rank a to rank b matches the k-th receive on b from a, whatever the
tags. Matched pairs must agree in shape and dtype (NCCL would not notice otherwise) and carry the
same message (else a rank would silently compute on another micro-batch's tensor).

A batch may also be one :class:`Collective` (an expert-parallel all-to-all, say): it completes
once every rank of its group has posted its collective of the same number on that group, and the
ranks must agree on what it is. One sequence per rank holding both (in the order the host issued
them) replays them as if every communicator shared one queue on each rank, the strictest case
(``CUDA_DEVICE_MAX_CONNECTIONS=1``, kernels that cannot run side by side, a host that waits):
an interleaving that completes there completes on separate streams too.

``replay(traces)`` raises :class:`NCCLDeadlock` or :class:`P2PMismatch`, naming the ranks, the
batches and the operations, or returns how many batches and operations ran.
"""
from __future__ import annotations

from dataclasses import dataclass


class NCCLDeadlock(RuntimeError):
    pass


class P2PMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class Collective:
    """A collective every rank of ``group`` (global ranks) takes part in, in issue order."""
    group: tuple
    label: str = ""
    op: str = "collective"

    def __repr__(self) -> str:
        return f"{self.label or 'collective'} on ranks {list(self.group)}"


@dataclass
class ReplayResult:
    batches: int
    operations: int


def _match(traces: dict) -> dict:
    """Partners of every operation: (rank, batch, index) -> [(rank, batch, index), ...] (one for
    a send or receive, the group's other ranks for a collective)."""
    sends, recvs, colls = {}, {}, {}
    for r, batches in traces.items():
        count: dict = {}
        for b, batch in enumerate(batches):
            for i, op in enumerate(batch):
                if op.op == "collective":
                    k = count[op.group] = count.get(op.group, -1) + 1
                    colls.setdefault((op.group, k), {})[r] = (r, b, i)
                    continue
                pair = (r, op.peer) if op.op == "send" else (op.peer, r)
                k = count[(op.op, pair)] = count.get((op.op, pair), -1) + 1
                (sends if op.op == "send" else recvs)[(pair, k)] = (r, b, i)
    partner, problems = {}, []
    for (group, k), posts in colls.items():
        labels = {r: _op(traces, where).label for r, where in posts.items()}
        if set(posts) != set(group) or len(set(labels.values())) > 1:
            problems.append(f"collective #{k + 1} on ranks {list(group)}: issued as {labels} (missing on "
                            f"{sorted(set(group) - set(posts))}; every rank of a group issues the same "
                            "in the same order)")
        for where in posts.values():
            partner[where] = [w for w in posts.values() if w != where]
    for key in sends.keys() | recvs.keys():
        (src, dst), k = key
        if key not in recvs:
            problems.append(f"rank {src}'s send #{k + 1} to rank {dst} ({_op(traces, sends[key])}) has no "
                            f"receive on rank {dst}")
            continue
        if key not in sends:
            problems.append(f"rank {dst}'s receive #{k + 1} from rank {src} ({_op(traces, recvs[key])}) has "
                            f"no send on rank {src}")
            continue
        s, rv = _op(traces, sends[key]), _op(traces, recvs[key])
        if (s.shape, s.dtype) != (rv.shape, rv.dtype):
            problems.append(f"send #{k + 1} rank {src} -> {dst} is {s.shape} {s.dtype}, its receive "
                            f"{rv.shape} {rv.dtype}")
        if s.label != rv.label:
            problems.append(f"send #{k + 1} rank {src} -> {dst} carries {s!r} but is received as {rv!r} "
                            "(NCCL pairs by order: the receiver would get another message)")
        partner[sends[key]], partner[recvs[key]] = [recvs[key]], [sends[key]]
    if problems:
        raise P2PMismatch("; ".join(sorted(problems)[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))
    return partner


def _op(traces, where):
    r, b, i = where
    return traces[r][b][i]


def replay(traces: dict, strict: bool = True) -> ReplayResult:
    """``traces``: rank -> list of batches, each a list of ``P2POp`` (``core/pipeline/p2p.py``)
    in issue order. Ranks absent from ``traces`` take part in no point-to-point operation."""
    partner, linked = pair_batches(traces)
    pos = {r: 0 for r in traces}
    matched: set = set()
    done_batches = done_ops = 0
    while True:
        current = {r: b for r, b in pos.items() if b < len(traces[r])}
        if not current:
            return ReplayResult(done_batches, done_ops)
        for r, b in current.items():  # an operation matches once both sides are posted
            if strict and not all(pos.get(q) == c for q, c in linked_batches((r, b), linked)):
                continue
            for i in range(len(traces[r][b])):
                if all(pos.get(pr) == pb for pr, pb, _ in partner[(r, b, i)]):
                    matched.add((r, b, i))
        advanced = [r for r, b in current.items()
                    if all((r, b, i) in matched for i in range(len(traces[r][b])))]
        if not advanced:
            raise NCCLDeadlock(_describe(traces, current, partner, matched, done_ops))
        for r in advanced:
            done_ops += len(traces[r][pos[r]])
            done_batches += 1
            pos[r] += 1


def pair_batches(traces: dict) -> tuple[dict, dict]:
    """(partner of every operation, (rank, batch) -> the batches its operations pair with)."""
    partner = _match(traces)
    linked: dict = {}
    for (r, b, _), others in partner.items():
        linked.setdefault((r, b), set()).update((pr, pb) for pr, pb, _ in others)
    return partner, linked


def linked_batches(start, linked: dict) -> set:
    """Every batch reachable from ``start`` through paired messages."""
    seen, todo = {start}, [start]
    while todo:
        for nxt in linked.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _describe(traces, current, partner, matched, done_ops) -> str:
    total = sum(len(b) for batches in traces.values() for b in batches)
    lines = [f"deadlock under NCCL's rules after {done_ops} of {total} operations:"]
    for r, b in sorted(current.items()):
        waiting = []
        for i, op in enumerate(traces[r][b]):
            if (r, b, i) not in matched:
                where = "; ".join(f"rank {pr}'s batch {pb}; rank {pr} is at batch "
                                  f"{current.get(pr, len(traces[pr]))}" for pr, pb, _ in partner[(r, b, i)])
                waiting.append(f"{op!r} (its partner is in {where})")
        lines.append(f"  rank {r} waits in batch {b}: " + "; ".join(waiting))
    return "\n".join(lines)
