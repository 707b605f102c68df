"""``apply_context_parallel``: the parallelize step that gives a chunk's attention modules and
routers the CP group (``training/parallelize.py``)."""
from __future__ import annotations

from torch import nn

from core.context_parallel.attention import ContextParallel
from core.context_parallel.exchange import CPComm
from core.moe.router import TopKRouter
from core.transformer.attention import Attention


def cp_comm(ps) -> CPComm:
    """This rank's CP group (one per rank, shared by its chunks: every CP rank then counts the
    same sequence of exchanges)."""
    return CPComm(ps.group("cp"), ps.ranks("cp"), ps.cp_rank)


def apply_context_parallel(chunk: nn.Module, comm: CPComm) -> None:
    """Attention modules attend across the CP group; routers sum their load statistics over it
    (the MoE auxiliary loss and the routing load are then the whole pack's). Any family whose
    blocks attend through core's ``Attention`` gets it (``models/common/decoder.py``); a block
    without one would attend within its shard only, so it is refused by name."""
    for i, block in chunk.blocks() if hasattr(chunk, "blocks") else ():
        if not any(isinstance(m, Attention) for m in block.modules()):
            raise ValueError(f"--context-parallel-size {comm.size}: block {i} of {type(chunk).__name__} has no "
                             "core.transformer.attention.Attention, so it cannot attend across the CP group; "
                             "build its attention from core's block or train without --context-parallel-size")
    for m in chunk.modules():
        if isinstance(m, Attention):
            m.context_parallel = ContextParallel(comm)
        elif isinstance(m, TopKRouter):
            m.stats_group = comm.group
