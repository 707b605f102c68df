"""Pipeline point-to-point communication as data: which messages each rank sends and receives
around each action of its schedule, grouped into batches that each run as one
``batch_isend_irecv`` and are waited on before the next action.

NCCL matches point-to-point operations between two ranks only in the order they are issued (it
ignores tags), and a large send blocks until its receive is posted unless both sit in one group.
The plan is therefore made for all ranks at once, in rounds: in each round every rank runs at
most one action of its list (one whose input arrived in an earlier round), then every message
produced in that round is sent by its producer and received by its consumer in that same round's
batch, ahead of its use if need be (Megatron posts the next receive with the current send for
the same reason). Both sides of a message sit in the same round and each rank's batches follow
the round order, so batches of round t can only wait on batches of rounds < t: no deadlock even
if every operation blocks until matched. Inside a batch the operations are ordered by message,
the same key on both sides, so NCCL's in-order matching pairs the right tensors.
``core/pipeline/nccl_replay.py`` replays the plans (and what the executor really issued) under
NCCL's rules to check all of this.

A message is named by ``(kind, micro-batch, stage)``: the activation that forward ``F`` of
``stage`` consumes, or the gradient that backward ``B`` of ``stage`` consumes.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.pipeline.schedules import Action


@dataclass(frozen=True)
class P2POp:
    op: str                 # "send" or "recv"
    peer: int               # global rank of the other side
    label: tuple            # (kind "F" / "B", micro-batch, consuming stage)
    shape: tuple = ()
    dtype: str = ""

    def __repr__(self) -> str:
        kind, m, s = self.label
        return f"{self.op} {kind}{m}@s{s} {'to' if self.op == 'send' else 'from'} {self.peer}"


@dataclass(frozen=True)
class Needs:
    """The messages around one action: received before it, sent after it."""

    recv: tuple = ()
    send: tuple = ()


def messages(a: Action, pp_rank: int, pp: int, num_stages: int, stage_rank) -> Needs:
    """``stage_rank(s)``: global rank that runs virtual stage ``s``."""
    s = a.chunk * pp + pp_rank
    if a.kind == "F":
        recv = (("recv", stage_rank(s - 1), ("F", a.microbatch, s)),) if s > 0 else ()
        send = (("send", stage_rank(s + 1), ("F", a.microbatch, s + 1)),) if s < num_stages - 1 else ()
    else:
        recv = (("recv", stage_rank(s + 1), ("B", a.microbatch, s)),) if s < num_stages - 1 else ()
        send = (("send", stage_rank(s - 1), ("B", a.microbatch, s - 1)),) if s > 0 else ()
    return Needs(recv, send)


def plan_all(schedule: list[list[Action]], pp_ranks: list[int] | None = None,
             shape: tuple = ("T", "H"), dtype: str = "act") -> dict[int, list]:
    """Programs of every rank of one pipeline (``pp_ranks``: their global ranks; default
    ``0..pp-1``). A program is a list whose items are an :class:`Action` or a batch (a non-empty
    list of :class:`P2POp`), in execution order."""
    pp = len(schedule)
    ranks = pp_ranks or list(range(pp))
    vpp = 1 + max((a.chunk for acts in schedule for a in acts), default=0)
    S = pp * vpp
    needs = [[messages(a, r, pp, S, lambda s: ranks[s % pp]) for a in acts] for r, acts in enumerate(schedule)]
    programs: dict[int, list] = {g: [] for g in ranks}
    pos, delivered = [0] * pp, [set() for _ in range(pp)]
    while any(pos[r] < len(schedule[r]) for r in range(pp)):
        batches: dict[int, list] = {g: [] for g in ranks}
        arrived, ran = [], False
        for r in range(pp):
            if pos[r] == len(schedule[r]):
                continue
            n = needs[r][pos[r]]
            if any(label not in delivered[r] for _, _, label in n.recv):
                continue  # its input comes in a later round
            programs[ranks[r]].append(schedule[r][pos[r]])
            pos[r] += 1
            ran = True
            for _, dst, label in n.send:
                batches[ranks[r]].append(("send", dst, label))
                batches[dst].append(("recv", ranks[r], label))
                arrived.append((ranks.index(dst), label))
        if not ran:
            raise RuntimeError("pipeline plan: no rank can run its next action (the schedule deadlocks)")
        for g, ops in batches.items():
            if ops:
                programs[g].append([P2POp(op, peer, label, shape, dtype)
                                    for op, peer, label in sorted(ops, key=lambda o: (o[2], o[0]))])
        for r, label in arrived:
            delivered[r].add(label)
    return programs


def batches_of(program: list) -> list[list[P2POp]]:
    """Only the communication of a program, in issue order (what the replay needs)."""
    return [item for item in program if isinstance(item, list)]


def max_live_buffers(program: list, pp_rank: int, pp: int, num_stages: int, inputs: bool = True) -> int:
    """Most ``[T, hidden]`` tensors a rank holds right after an action when each is released as
    the executor does at the latest: stage inputs until their backward, received messages until
    their action consumes them, outputs and input gradients until their batch is retired (at the
    latest when an action waits for a message of that batch or a later one). The executor's
    measured ``peak_held_bytes`` stays within this many buffers (it also retires batches it
    finds complete earlier). ``inputs=False``: only the p2p buffers (received, unsent)."""
    live: set = set()
    inflight: list = []  # issued batches not yet retired
    peak = 0
    for item in program:
        if isinstance(item, list):
            inflight.append(item)
            live.update(("in", op.label) for op in item if op.op == "recv")
            continue
        s = item.chunk * pp + pp_rank
        m = item.microbatch
        need = ("F", m, s) if item.kind == "F" else ("B", m, s)
        waits = [i for i, b in enumerate(inflight) if any(op.op == "recv" and op.label == need for op in b)]
        for b in inflight[:waits[0] + 1] if waits else []:
            live.difference_update(("out", op.label) for op in b if op.op == "send")
        inflight = inflight[waits[0] + 1:] if waits else inflight
        live.discard(("in", need))
        if item.kind == "F":
            if s > 0:  # the received activation becomes the stage input, kept for backward
                live.add(("input", m, s))
            if s < num_stages - 1:
                live.add(("out", ("F", m, s + 1)))
        else:
            live.discard(("input", m, s))
            if s > 0:
                live.add(("out", ("B", m, s - 1)))
        peak = max(peak, len(live) if inputs else sum(1 for x in live if x[0] != "input"))
    return peak
