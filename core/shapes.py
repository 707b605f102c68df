"""What a model's blocks look like to the cost models: shapes only, no weights.

A family describes each decoder layer (and each extra block after the last layer, such as a
multi-token-prediction depth) as a :class:`BlockShape` built from core's block options; the FLOP
model (``core/flops.py``), the activation-byte model (``core/activations.py``) and the planner
read these and nothing else of the model. The numbers they give are those of core's blocks as
this code builds them (what our attention, norms, router and experts keep for backward).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    heads: int                 # query heads
    kv_heads: int
    head_dim: int
    window: int | None = None  # keys seen counting the query (sliding window); None: causal full
    gate: bool = False         # head-wise sigmoid gate (``g_proj``: hidden -> heads)
    rotary_dim: int = 0        # dims each head rotates (head_dim * partial rotary factor)


@dataclass(frozen=True)
class FFNShape:
    kind: str                  # "dense" (SwiGLU) or "moe"
    size: int                  # dense intermediate size, or each routed expert's
    experts: int = 0           # routed experts (all of them, before expert parallelism)
    top_k: int = 0
    shared: int = 0            # always-on shared expert's intermediate size (0: none)
    clamped: bool = False      # SwiGLU clamp on the dense MLP / routed experts
    shared_clamped: bool = False

    def __post_init__(self):
        if self.kind not in ("dense", "moe"):
            raise ValueError(f"FFNShape.kind {self.kind!r}: expected dense or moe")

    @property
    def moe(self) -> bool:
        return self.kind == "moe"


@dataclass(frozen=True)
class BlockShape:
    attention: AttentionShape
    ffn: FFNShape
    input_proj: int = 0        # an extra block's input projection: in-features (MTP: 2 x hidden)
    head: bool = False         # an extra block with its own output head (MTP depth)


@dataclass(frozen=True)
class ModelShapes:
    """A whole model: its decoder layers (``blocks``) in order, then ``extra`` blocks that run after the last layer
    on the last pipeline stage (each with its own head when ``head``)."""

    hidden: int
    vocab: int
    blocks: tuple              # the decoder layers' shapes, in order
    extra: tuple = ()

    def block(self, index: int) -> BlockShape:
        """Decoder layer ``index``, or extra block ``k`` as ``index = -1 - k``."""
        return self.blocks[index] if index >= 0 else self.extra[-1 - index]
