"""``--compile``: ``torch.compile`` per decoder layer and MTP depth, ``fullgraph=True``.

``fullgraph`` turns any graph break (a host read of a tensor value, an unsupported call) into an
error at the first step rather than a silent slowdown. Each block is compiled once per shape:
the document layout reaches the graph as tensors whose length is marked dynamic
(``core/transformer/attention_op.py``), so new packs do not recompile. Blocks with the same
configuration share a graph (parameters are graph inputs); blocks that differ (dense or MoE
FFN, sliding or full attention, a SwiGLU clamp) get one graph each.

Only ``forward`` methods are compiled, never a module's call: FSDP's hooks (gather before a
unit's forward, reduce after its backward) stay outside the graphs, so this runs after FSDP.

A layer that cannot be one graph is compiled in the pieces around what must stay eager: its
dispatcher reads the all-to-all split sizes on the host (expert parallelism), or FSDP wraps
units inside it (the experts over expert-DP, the fp32 router under ``--bf16``), whose hooks
must run between pieces. The pieces are the attention block (norm, attention, residual, norm),
the router, the shared expert and the experts (under expert parallelism their row count
depends on routing: the dispatcher marks it dynamic, so one graph serves every count);
permutation, all-to-all and the weighted combine run eagerly between them, and so do an MTP
depth's own projections.
"""
from __future__ import annotations

import torch
import torch._dynamo
from torch.distributed.fsdp import FSDPModule

from core.moe.layer import MoELayer
from models.step37.model import DecoderLayer, MTPDepth, Step37Model

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def _one_graph(block: torch.nn.Module) -> bool:
    """No communicating dispatcher and no FSDP unit inside (the block itself may be one)."""
    return not any((isinstance(m, MoELayer) and m.dispatcher.communicates)
                   or (m is not block and isinstance(m, FSDPModule)) for m in block.modules())


def _compile_forward(module: torch.nn.Module, backend: str) -> None:
    module.forward = torch.compile(module.forward, fullgraph=True, backend=backend)


def _compile_pieces(layer: DecoderLayer, backend: str) -> None:
    layer.attention_block = torch.compile(layer.attention_block, fullgraph=True, backend=backend)
    ffn = getattr(layer, "mlp", None) or layer.moe
    if isinstance(ffn, MoELayer):
        _compile_forward(ffn.router, backend)
        _compile_forward(ffn.shared_expert, backend)
        _compile_forward(ffn.experts, backend)  # a communicating dispatcher marks its rows dynamic
    else:
        _compile_forward(ffn, backend)


def apply_compile(model: Step37Model, backend: str = "inductor") -> int:
    """Compile ``model``'s blocks in place; returns how many blocks were compiled whole."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile-backend {backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
    if model.config.attention_backend in ("flex", "transformer_engine"):
        raise ValueError(f"--compile does not support --attention-backend {model.config.attention_backend} "
                         "(flex is compiled on its own; Transformer Engine's kernels stay eager); use "
                         "auto (varlen on CUDA, sdpa on CPU)")
    blocks = list(model.layers.values()) + (list(model.mtp.values()) if model.mtp is not None else [])
    raise_recompile_limit(len(blocks))
    return sum(compile_block(block, backend) for block in blocks)


def raise_recompile_limit(num_blocks: int) -> None:
    """One graph per distinct block configuration, each block's pieces included: room for all."""
    limit = 4 * num_blocks + 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_cache_size_limit = max(
        torch._dynamo.config.accumulated_cache_size_limit, 4 * limit)


def compile_block(block: DecoderLayer | MTPDepth, backend: str = "inductor") -> bool:
    """Compile one block in place: whole when it can be one graph (returns True), else in
    pieces around its dispatcher and inner FSDP units."""
    if _one_graph(block):
        _compile_forward(block, backend)
        return True
    _compile_pieces(block.block if isinstance(block, MTPDepth) else block, backend)
    return False
