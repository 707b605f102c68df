"""``apply_context_parallel``: the parallelize step that gives a chunk's attention modules and
routers the CP group (``training/parallelize.py``)."""
from __future__ import annotations

from torch import nn

from core.context_parallel.attention import ContextParallel
from core.context_parallel.exchange import CPComm
from core.moe.router import TopKRouter
from core.transformer.attention import attention_modules, is_attention


def cp_comm(ps) -> CPComm:
    """This rank's CP group (one per rank, shared by its chunks: every CP rank then counts the
    same sequence of exchanges)."""
    return CPComm(ps.group("cp"), ps.ranks("cp"), ps.cp_rank)


def apply_context_parallel(chunk: nn.Module, comm: CPComm) -> None:
    """Attention modules attend across the CP group; routers sum their load statistics over it
    (the MoE auxiliary loss and the routing load are then the whole pack's). Any family whose
    blocks attend through an attention kind of core's that ``supports_context_parallel`` (the
    protocol of ``core/transformer/attention.py``: GQA ``Attention`` exchanges K/V, ``MLAttention``
    its compressed latent) gets it; a block without one (no core attention, or a kind with no CP
    exchange) would attend within its shard only, so it is refused by name."""
    name = type(chunk).__name__
    for i, block in chunk.blocks() if hasattr(chunk, "blocks") else ():
        if not attention_modules(block):
            raise ValueError(f"--context-parallel-size {comm.size}: block {i} of {name} has no attention module "
                             "of core's (core/transformer/attention.py), so it cannot attend across the CP group; "
                             "build its attention from core's blocks or train without --context-parallel-size")
    for path, m in chunk.named_modules():
        if is_attention(m) and not m.supports_context_parallel:
            raise ValueError(f"--context-parallel-size {comm.size}: {name}'s {path} is {type(m).__name__}, which "
                             "has no CP exchange yet, so it cannot attend across the CP group; train without "
                             "--context-parallel-size")
    for m in attention_modules(chunk):
        m.context_parallel = ContextParallel(comm)
    for m in chunk.modules():
        if isinstance(m, TopKRouter):
            m.stats_group = comm.group
