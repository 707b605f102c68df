"""``--compile``: ``torch.compile`` per block of a chunk (``chunk.blocks()``), ``fullgraph=True``.

``fullgraph`` turns any graph break (a host read of a tensor value, an unsupported call) into an
error at the first step rather than a silent slowdown. Each block is compiled once per shape:
the document layout reaches the graph as tensors whose length is marked dynamic
(``core/transformer/attention_op.py``), so new packs do not recompile. Blocks with the same
configuration share a graph (parameters are graph inputs); blocks that differ (dense or MoE
FFN, sliding or full attention, a SwiGLU clamp) get one graph each.

Only ``forward`` methods are compiled, never a module's call: FSDP's hooks (gather before a
unit's forward, reduce after its backward) stay outside the graphs, so this runs after FSDP.

A block that cannot be one graph is compiled in the pieces around what must stay eager: its
dispatcher reads the all-to-all split sizes on the host (expert parallelism), or FSDP wraps
units inside it (the experts over expert-DP, the fp32 router under ``--bf16``), whose hooks
must run between pieces. The pieces, per :class:`~core.transformer.block.DecoderBlock` inside
it, are the attention block (norm, attention, residual, norm), the router, the shared expert
and the experts (under expert parallelism their row count depends on routing: the dispatcher
marks it dynamic, so one graph serves every count); permutation, all-to-all and the weighted
combine run eagerly between them, and so does whatever else the block does around its decoder
block (an MTP depth's own projections).
"""
from __future__ import annotations

import torch
import torch._dynamo
import torch._dynamo.config as dynamo_config
from torch.distributed.fsdp import FSDPModule

from core.moe.layer import MoELayer
from core.transformer.attention import attention_modules
from core.transformer.block import DecoderBlock

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def _one_graph(block: torch.nn.Module) -> bool:
    """No communicating dispatcher and no FSDP unit inside (the block itself may be one)."""
    return not any((isinstance(m, MoELayer) and m.dispatcher.communicates)
                   or (m is not block and isinstance(m, FSDPModule)) for m in block.modules())


def _compile_forward(module: torch.nn.Module, backend: str) -> None:
    module.forward = torch.compile(module.forward, fullgraph=True, backend=backend)


def _compile_pieces(layer: DecoderBlock, backend: str) -> None:
    layer.attention_block = torch.compile(layer.attention_block, fullgraph=True, backend=backend)
    ffn = layer.ffn
    if isinstance(ffn, MoELayer):
        _compile_forward(ffn.router, backend)
        if ffn.shared_expert is not None:
            _compile_forward(ffn.shared_expert, backend)
        _compile_forward(ffn.experts, backend)  # a communicating dispatcher marks its rows dynamic
    else:
        _compile_forward(ffn, backend)


def check_backend(backend: str, attention_backend: str) -> None:
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile-backend {backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")
    if attention_backend in ("flex", "transformer_engine"):
        raise ValueError(f"--compile does not support --attention-backend {attention_backend} "
                         "(flex is compiled on its own; Transformer Engine's kernels stay eager); use "
                         "auto (varlen on CUDA, sdpa on CPU)")


def apply_compile(chunk: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile ``chunk``'s blocks in place; returns how many blocks were compiled whole."""
    for attention_backend in sorted({m.backend for m in attention_modules(chunk)}) or ["auto"]:
        check_backend(backend, attention_backend)
    blocks = [m for _, m in chunk.blocks()]
    raise_recompile_limit(len(blocks))
    return sum(compile_block(block, backend) for block in blocks)


def raise_recompile_limit(num_blocks: int) -> None:
    """One graph per distinct block configuration, each block's pieces included: room for all."""
    limit = 4 * num_blocks + 8
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, limit)
    dynamo_config.accumulated_cache_size_limit = max(dynamo_config.accumulated_cache_size_limit, 4 * limit)


def compile_block(block: torch.nn.Module, backend: str = "inductor") -> bool:
    """Compile one block in place: whole when it can be one graph (returns True), else in
    pieces around its dispatcher and inner FSDP units."""
    if _one_graph(block):
        _compile_forward(block, backend)
        return True
    for m in block.modules():
        if isinstance(m, DecoderBlock):
            _compile_pieces(m, backend)
    return False
