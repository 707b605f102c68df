"""``--compile``: ``torch.compile`` per decoder layer and MTP depth, ``fullgraph=True``.

``fullgraph`` turns any graph break (a host read of a tensor value, an unsupported call) into an
error at the first step rather than a silent slowdown. Each block is compiled once per shape:
the document layout reaches the graph as tensors whose length is marked dynamic
(``core/transformer/attention_op.py``), so new packs do not recompile. Blocks with the same
configuration share a graph (parameters are graph inputs); blocks that differ (dense or MoE
FFN, sliding or full attention, a SwiGLU clamp) get one graph each.

A layer whose experts live on other ranks cannot be one graph: its dispatcher reads the
all-to-all split sizes on the host. Such a layer is compiled in the pieces around the
dispatch: the attention block (norm, attention, residual, norm), the router, the shared
expert and the experts (whose row count depends on routing, so that graph has a dynamic
first dimension); permutation, all-to-all and the weighted combine run eagerly between them.
The MTP depth's own projections then run eagerly too.

Applied after recompute (a checkpointed region is traced as one) and before FSDP, whose hooks
run outside the compiled graphs.
"""
from __future__ import annotations

import torch
import torch._dynamo

from core.moe.layer import MoELayer
from models.step37.model import DecoderLayer, MTPDepth, Step37Model

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def _communicates(block: torch.nn.Module) -> bool:
    return any(isinstance(m, MoELayer) and m.dispatcher.communicates for m in block.modules())


def _compile_pieces(layer: DecoderLayer, backend: str) -> None:
    layer.attention_block = torch.compile(layer.attention_block, fullgraph=True, backend=backend)
    moe = layer.moe
    moe.router.compile(fullgraph=True, backend=backend)
    moe.shared_expert.compile(fullgraph=True, backend=backend)
    moe.experts.compile(fullgraph=True, backend=backend, dynamic=True)


def apply_compile(model: Step37Model, backend: str = "inductor") -> int:
    """Compile ``model``'s blocks in place; returns how many blocks were compiled whole."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile-backend {backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
    if model.config.attention_backend == "flex":
        raise ValueError("--compile does not support --attention-backend flex (flex_attention is "
                         "compiled on its own); use auto (varlen on CUDA, sdpa on CPU)")
    blocks = list(model.layers.values()) + (list(model.mtp.values()) if model.mtp is not None else [])
    # one graph per distinct block configuration, each layer's pieces included: room for all
    limit = 4 * len(blocks) + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 4 * limit)
    whole = 0
    for block in blocks:
        if not _communicates(block):
            block.compile(fullgraph=True, backend=backend)
            whole += 1
        else:
            _compile_pieces(block.block if isinstance(block, MTPDepth) else block, backend)
    return whole
