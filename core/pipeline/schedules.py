"""Pipeline schedules as data: for each rank, the ordered list of actions it performs.

An action is ``(kind, microbatch, chunk)`` with kind ``"F"`` (forward) or ``"B"`` (backward);
``chunk`` is the rank's virtual chunk. Virtual stage of chunk ``c`` on rank ``r`` is
``c * pp + r`` (Megatron's interleaving), so stage ``s`` feeds stage ``s + 1`` on the next rank.
The same lists drive the executor and the simulator.
"""
from __future__ import annotations

from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def no_pipelining(num_microbatches: int) -> list[Action]:
    """One stage: forward and backward of each micro-batch in turn (one in flight)."""
    return [a for m in range(num_microbatches) for a in (Action("F", m), Action("B", m))]


def one_f_one_b(rank: int, pp: int, num_microbatches: int) -> list[Action]:
    """Non-interleaved 1F1B: ``pp - rank - 1`` warm-up forwards, then alternate, then drain.
    At most ``pp - rank`` micro-batches are in flight on a rank."""
    M = num_microbatches
    warmup = min(pp - rank - 1, M)
    acts = [Action("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < M:
        acts += [Action("F", f), Action("B", b)]
        f, b = f + 1, b + 1
    acts += [Action("B", m) for m in range(b, M)]
    return acts


def interleaved_1f1b(rank: int, pp: int, vpp: int, num_microbatches: int) -> list[Action]:
    """Interleaved 1F1B (Megatron): micro-batches go through the ``vpp`` chunks in groups of
    ``pp``; needs ``num_microbatches % pp == 0``."""
    M = num_microbatches
    if M % pp:
        raise ValueError(f"interleaved schedule needs the number of micro-batches ({M}) to be a "
                         f"multiple of --pipeline-model-parallel-size ({pp})")
    total = M * vpp

    def forward_of(k: int) -> Action:
        group, i = divmod(k, pp * vpp)
        return Action("F", group * pp + i % pp, i // pp)

    def backward_of(k: int) -> Action:
        group, i = divmod(k, pp * vpp)
        return Action("B", group * pp + i % pp, vpp - 1 - i // pp)

    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    acts = [forward_of(k) for k in range(warmup)]
    f, b = warmup, 0
    while f < total:
        acts += [forward_of(f), backward_of(b)]
        f, b = f + 1, b + 1
    acts += [backward_of(k) for k in range(b, total)]
    return acts


def build_schedule(pp: int, vpp: int, num_microbatches: int) -> list[list[Action]]:
    """Action lists for every pipeline rank."""
    if pp == 1:
        if vpp != 1:
            raise ValueError("virtual stages need pp > 1")
        return [no_pipelining(num_microbatches)]
    if vpp == 1:
        return [one_f_one_b(r, pp, num_microbatches) for r in range(pp)]
    return [interleaved_1f1b(r, pp, vpp, num_microbatches) for r in range(pp)]
