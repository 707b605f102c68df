"""Parallelism applied to Step37Model from outside, in one documented order:

1. ``stage_layers``: split the layers over ``pp * vpp`` virtual stages (balanced, or
   ``--pipeline-layout``);
2. ``build_chunks``: this rank's ``vpp`` chunks (first stage: embedding; last: norm, head, MTP);
3. ``apply_expert_parallel``: keep this EP rank's ``E / ep`` experts and route through the
   all-to-all (or all-gather) dispatcher;
4. ``apply_recompute``: activation checkpointing of whole layers (``full``) or of attention and
   FFN internals (``selective``), on the first ``num_layers`` layers of each chunk (0: all).
"""
from __future__ import annotations

import torch

from core.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher
from core.moe.layer import MoELayer
from core.parallel_state import ParallelState
from models.step37.config import Step37Config
from models.step37.model import Step37Model


def stage_layers(num_layers: int, num_stages: int, layout: str | None = None) -> list[range]:
    """Contiguous layer ranges per virtual stage. ``layout``: comma-separated layer counts
    (e.g. ``"10,12,12,11"``, fewer where the embedding or the head sit); default balanced,
    with the remainder going to the middle stages."""
    if layout:
        counts = [int(x) for x in layout.split(",")]
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"--pipeline-layout {layout!r}: need {num_stages} positive counts "
                             f"summing to {num_layers}")
    else:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
        base, extra = divmod(num_layers, num_stages)
        first_extra = (num_stages - extra) // 2
        counts = [base + (first_extra <= s < first_extra + extra) for s in range(num_stages)]
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def build_chunks(config: Step37Config, pstate: ParallelState, layout: str | None = None,
                 *, dispatcher: str = "alltoall", device="cpu") -> list[Step37Model]:
    pp, vpp = pstate.sizes.pp, pstate.sizes.vpp
    ranges = stage_layers(config.num_layers, pp * vpp, layout)
    chunks = []
    for c in range(vpp):
        s = c * pp + pstate.pp_rank
        with torch.device(device):
            chunk = Step37Model(config, layers=ranges[s], first=s == 0, last=s == pp * vpp - 1,
                                experts=_expert_range(config, pstate))
        if pstate.sizes.ep > 1:
            apply_expert_parallel(chunk, pstate, dispatcher)
        chunks.append(chunk)
    return chunks


def _expert_range(config: Step37Config, pstate: ParallelState) -> range:
    local = config.num_experts // pstate.sizes.ep
    return range(pstate.ep_rank * local, (pstate.ep_rank + 1) * local)


def apply_expert_parallel(model: torch.nn.Module, pstate: ParallelState, kind: str = "alltoall") -> None:
    """Route every MoE layer's tokens to the EP rank that holds their experts."""
    ep, group = pstate.sizes.ep, pstate.group("ep")
    for m in model.modules():
        if isinstance(m, MoELayer):
            E = m.router.num_experts
            if kind == "alltoall":
                m.dispatcher = AllToAllDispatcher(group, ep, E)
            elif kind == "allgather":
                m.dispatcher = AllGatherDispatcher(group, ep, pstate.ep_rank, E)
            else:
                raise ValueError(f"--moe-dispatcher {kind!r}: expected alltoall or allgather")


def apply_recompute(model: Step37Model, granularity: str, num_layers: int = 0) -> None:
    if granularity not in ("none", "selective", "full"):
        raise ValueError(f"--recompute-granularity {granularity!r}: expected none, selective or full")
    layers = list(model.layers.values())
    chosen = layers if num_layers <= 0 else layers[:num_layers]
    for layer in chosen:
        layer.recompute = granularity
