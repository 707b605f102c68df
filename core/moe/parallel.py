"""Expert parallelism applied from outside: every MoE layer of a chunk routes its tokens to the
EP rank that holds their experts (the layer's maths is unchanged: experts see only local rows)."""
from __future__ import annotations

import torch

from core.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher
from core.moe.layer import MoELayer
from core.parallel_state import ParallelState

DISPATCHERS = ("alltoall", "allgather")


def apply_expert_parallel(model: torch.nn.Module, pstate: ParallelState, kind: str = "alltoall") -> None:
    """Route every MoE layer's tokens to the EP rank that holds their experts."""
    if kind not in DISPATCHERS:
        raise ValueError(f"--moe-dispatcher {kind!r}: expected alltoall or allgather")
    ep, group = pstate.sizes.ep, pstate.group("ep")
    for m in model.modules():
        if isinstance(m, MoELayer):
            E = m.router.num_experts
            m.dispatcher = AllToAllDispatcher(group, ep, E) if kind == "alltoall" else \
                AllGatherDispatcher(group, ep, pstate.ep_rank, E)
