"""LoRA's costs for the time model (``timing.py``): the weight-gradient FLOPs a frozen base skips
and the adapters' own GEMMs (``core/finetune/lora.py``); its memory is booked by ``memory.py`` from the
shares, which carry the adapters and the frozen flag (``shares.py``)."""
from __future__ import annotations

from core.costs.flops import block_params
from models.registry import shapes_of
from training.planner.inputs import PlanInputs
from training.planner.shares import ChunkShare


def adapter_flops(hidden: int, b, rank: int, targets) -> float:
    """Forward FLOPs per token of one block's LoRA adapters (``core/finetune/lora.py``): ``2 r (in + out)``
    per adapted projection (a token's top-k experts' for the routed ones; the attention's
    projections as its shape lists them: GQA's q, k, v, o and gate, MLA's low-rank ones)."""
    f, H = b.ffn, hidden
    ends = 0
    if "attention" in targets:
        ends += b.attention.adapter_ends(H)
    if not f.moe and "mlp" in targets:
        ends += 3 * (H + f.size)
    if f.moe and f.shared and "shared_expert" in targets:
        ends += 3 * (H + f.shared)
    if f.moe and "experts" in targets:
        ends += f.top_k * 3 * (H + f.size)
    return 2.0 * rank * ends


def lora_flops(cfg, chunk: ChunkShare, inp: PlanInputs) -> tuple[float, float]:
    """Per token of a LoRA run's chunk: the weight-gradient FLOPs its frozen base skips (every
    weight of the chunk: a backward computes only the input gradients through them), and its
    adapters' forward FLOPs (their backward is twice that)."""
    if not inp.lora_rank:
        return 0.0, 0.0
    shapes = shapes_of(cfg)
    targets = {t.strip() for t in inp.lora_targets.split(",")}
    blocks = [shapes.blocks[i] for i in chunk.layers] + (list(shapes.extra) if chunk.last else [])
    frozen = sum(2.0 * block_params(shapes.hidden, shapes.vocab, b) for b in blocks)
    frozen += 2.0 * shapes.hidden * shapes.vocab if chunk.last else 0.0  # the main head
    return frozen, sum(adapter_flops(shapes.hidden, b, inp.lora_rank, targets) for b in blocks)
