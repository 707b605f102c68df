"""``apply_context_parallel``: the parallelize step that gives a chunk's attention modules and
routers the CP group (``training/parallelize.py``)."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn

from core.context_parallel.attention import ContextParallel
from core.context_parallel.exchange import CPComm
from core.moe.router import TopKRouter


@runtime_checkable
class CPAttention(Protocol):
    """An attention module that attends across the CP group: it declares ``context_parallel``
    (``None`` until :func:`apply_context_parallel` sets a :class:`ContextParallel`) and, on a CP
    shard, attends through it: ``cp_attention`` with its K/V (core's GQA ``Attention``) or
    ``cp_latent_attention`` with a per-token latent it expands itself (``core.transformer.mla``)."""

    context_parallel: ContextParallel | None


def cp_comm(ps) -> CPComm:
    """This rank's CP group (one per rank, shared by its chunks: every CP rank then counts the
    same sequence of exchanges)."""
    return CPComm(ps.group("cp"), ps.ranks("cp"), ps.cp_rank)


def apply_context_parallel(chunk: nn.Module, comm: CPComm) -> None:
    """Attention modules (:class:`CPAttention`) attend across the CP group; routers sum their
    load statistics over it (the MoE auxiliary loss and the routing load are then the whole
    pack's). Any family whose blocks attend through core's ``Attention`` or ``MLAttention`` gets
    it; a block without such a module would attend within its shard only, so it is refused by
    name."""
    for i, block in chunk.blocks() if hasattr(chunk, "blocks") else ():
        if not any(isinstance(m, CPAttention) for m in block.modules()):
            raise ValueError(f"--context-parallel-size {comm.size}: block {i} of {type(chunk).__name__} has no "
                             "attention module that attends across the CP group (a `context_parallel` attribute: "
                             "core.transformer.attention.Attention or core.transformer.mla.MLAttention); build its "
                             "attention from core's modules or train without --context-parallel-size")
    for m in chunk.modules():
        if isinstance(m, CPAttention):
            m.context_parallel = ContextParallel(comm)
        elif isinstance(m, TopKRouter):
            m.stats_group = comm.group
