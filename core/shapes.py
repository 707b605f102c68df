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


def conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    """Output side of a square convolution over a ``size`` x ``size`` grid."""
    return (size + 2 * padding - kernel) // stride + 1


@dataclass(frozen=True)
class VisionShape:
    """An image encoder in front of the decoder (it runs on the first pipeline stage): a patch
    embedding (a ``patch`` x ``patch`` convolution, stride ``patch``, no bias), a learned position
    table of ``positions`` rows, a pre-norm, ``depth`` pre-norm ViT blocks (LayerNorm, attention
    with biases over every patch of one view, bidirectional; LayerNorm, ``fc1`` -> activation ->
    ``fc2`` with biases; a layer scale after each), then ``downsamplers`` (square convolutions with
    bias, each ``(out_channels, kernel, stride, padding)``) and a linear projector to the decoder's
    ``out_hidden``. One image is a global view of ``image_size`` pixels square and, on average,
    some crops of ``crop_size`` (0: none); each view yields ``features(size)`` decoder tokens."""

    hidden: int
    intermediate: int
    depth: int                 # ViT blocks
    heads: int
    patch: int
    image_size: int
    crop_size: int = 0
    channels: int = 3
    positions: int = 0
    downsamplers: tuple = ()
    out_hidden: int = 0
    projector_bias: bool = False

    def grid(self, size: int) -> int:
        """Patches per side of a view of ``size`` pixels."""
        return size // self.patch

    def patches(self, size: int) -> int:
        return self.grid(size) ** 2

    def features(self, size: int) -> int:
        """Decoder tokens one view of ``size`` pixels becomes (the downsampled grid)."""
        g = self.grid(size)
        for _, k, s, p in self.downsamplers:
            g = conv_out(g, k, s, p)
        return g * g

    @property
    def feature_dim(self) -> int:
        """Channels into the projector (the last downsampler's, else the tower's)."""
        return self.downsamplers[-1][0] if self.downsamplers else self.hidden

    def parameters(self) -> list:
        """``(name, shape, layer, role)`` of every weight as the cost models count it: ``layer`` is
        the ViT block's index (``None`` outside the blocks), ``role`` ``"embedding"`` for the
        position table (AdamW even under Muon) else ``"weight"``. Convolution weights are listed
        flattened to ``[out, in x k x k]`` (how a matrix optimizer sees them)."""
        H, I = self.hidden, self.intermediate
        out = [("patch_embedding", (H, self.channels * self.patch ** 2), None, "weight")]
        if self.positions:
            out.append(("position_embedding", (self.positions, H), None, "embedding"))
        out += [("pre_norm.weight", (H,), None, "weight"), ("pre_norm.bias", (H,), None, "weight")]
        for i in range(self.depth):
            for name in ("q", "k", "v", "o"):
                out += [(f"layers.{i}.{name}.weight", (H, H), i, "weight"), (f"layers.{i}.{name}.bias", (H,), i, "weight")]
            out += [(f"layers.{i}.fc1.weight", (I, H), i, "weight"), (f"layers.{i}.fc1.bias", (I,), i, "weight"),
                    (f"layers.{i}.fc2.weight", (H, I), i, "weight"), (f"layers.{i}.fc2.bias", (H,), i, "weight")]
            out += [(f"layers.{i}.{n}", (H,), i, "weight") for n in
                    ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "scale1", "scale2")]
        c = H
        for j, (o, k, _, _) in enumerate(self.downsamplers):
            out += [(f"downsampler{j}.weight", (o, c * k * k), None, "weight"), (f"downsampler{j}.bias", (o,), None, "weight")]
            c = o
        out.append(("projector.weight", (self.out_hidden, c), None, "weight"))
        if self.projector_bias:
            out.append(("projector.bias", (self.out_hidden,), None, "weight"))
        return out


@dataclass(frozen=True)
class ModelShapes:
    """A whole model: its decoder layers (``blocks``) in order, then ``extra`` blocks that run after the last layer
    on the last pipeline stage (each with its own head when ``head``)."""

    hidden: int
    vocab: int
    blocks: tuple              # the decoder layers' shapes, in order
    extra: tuple = ()
    vision: VisionShape | None = None  # an image encoder on the first stage (vision-language models)

    def block(self, index: int) -> BlockShape:
        """Decoder layer ``index``, or extra block ``k`` as ``index = -1 - k``."""
        return self.blocks[index] if index >= 0 else self.extra[-1 - index]
