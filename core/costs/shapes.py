"""What a model's blocks look like to the cost models: shapes only, no weights.

A family describes each decoder layer (and each extra block after the last layer, such as a
multi-token-prediction depth) as a :class:`BlockShape` built from core's block options; the FLOP
model (``core/costs/flops.py``), the activation-byte model (``core/costs/activations.py``), the context-parallel
costs (``core/context_parallel/costs.py``) and the planner read these and nothing else of the model.
The numbers they give are those of core's blocks as this code builds them (what our attention,
norms, router and experts keep for backward).

Each attention kind is a shape that owns its costs (the protocol below; :class:`AttentionShape`
for GQA, :class:`MLAShape` for multi-head latent attention): the cost models ask the shape and
never read a kind's fields, so a new kind is one class here and nothing else changes.

- ``params(hidden)``: weights a token multiplies through (matmuls; biases and norms left out);
- ``score_flops(keys)``: forward FLOPs of ``q.k`` and ``p.v`` over ``keys`` (query, key) pairs;
- ``flops(hidden, tokens, keys)``: forward FLOPs of ``tokens`` tokens reading ``keys`` keys in all;
- ``kernel``: ``(heads, kv_heads, qk_dim, v_dim)`` as the attention kernel sees them;
- ``kept_bytes(hidden, T, b)``: what the attention half of a block keeps for backward without
  recompute (its input norm included), under a fused kernel; ``selective`` and ``full`` recompute
  keep the same for every kind (``core/costs/activations.py``: the norms and the residual stream, or the
  layer input);
- ``frozen_savings(hidden, T, b, rank)``: what it keeps less with its base frozen (LoRA), with
  ``rank`` > 0 its adapters' ``x A^T`` kept more (``core/activations.frozen_savings``);
- ``adapter_ends(hidden)``: ``in + out`` summed over the projections LoRA's ``attention`` target
  adapts (an adapter costs ``2 r (in + out)`` FLOPs per token);
- ``exchange_row_bytes(b)``: one token's bytes the context-parallel exchange moves;
- ``key_row_bytes(b)``: one key row of the buffer the context-parallel attention keeps;
- ``expand_flops(rows)``: forward FLOPs of turning ``rows`` exchanged rows into K/V on the
  receiving rank (0 where K/V themselves move, GQA; MLA's ``kv_b_proj``);
- ``window``: keys seen counting the query, ``None`` for the whole causal document.
"""
from __future__ import annotations

from dataclasses import dataclass

F32 = 4


def norm_bytes(T: int, n: int, b: int) -> int:
    """An RMSNorm over ``n`` features: its fp32 input (a copy when b < 4, the input itself in
    fp32), its normalised fp32 output and 1/rms."""
    return 2 * T * n * F32 + T * F32


@dataclass(frozen=True)
class AttentionShape:
    """GQA attention (``core/transformer/attention.py``): q, k, v and o projections, per-head q/k
    norms, rope on ``rotary_dim`` dims of each head, an optional head-wise sigmoid gate."""

    heads: int                 # query heads
    kv_heads: int
    head_dim: int
    window: int | None = None  # keys seen counting the query (sliding window); None: causal full
    gate: bool = False         # head-wise sigmoid gate (``g_proj``: hidden -> heads)
    rotary_dim: int = 0        # dims each head rotates (head_dim * partial rotary factor)

    @property
    def kernel(self) -> tuple:
        return self.heads, self.kv_heads, self.head_dim, self.head_dim

    def params(self, hidden: int) -> int:
        """q, k, v, the head gate, o."""
        return hidden * (self.heads * self.head_dim + 2 * self.kv_heads * self.head_dim
                         + (self.heads if self.gate else 0)) + self.heads * self.head_dim * hidden

    def score_flops(self, keys):
        heads, _, qk, v = self.kernel
        return 2 * heads * (qk + v) * keys

    def flops(self, hidden: int, tokens, keys):
        return 2 * self.params(hidden) * tokens + self.score_flops(keys)

    def kept_bytes(self, hidden: int, T: int, b: int) -> int:
        D, Hq, Hkv, rot = self.head_dim, self.heads, self.kv_heads, self.rotary_dim
        q = T * Hq * D
        kv = T * Hkv * D
        total = norm_bytes(T, hidden, b) + T * hidden * b                  # input norm + its output
        total += norm_bytes(T, Hq * D, b) + norm_bytes(T, Hkv * D, b)      # q_norm, k_norm
        total += q * b * (5 if self.gate else 4) + q * b * rot // D        # normed, rotated, embedded q; output (gated)
        total += kv * b * 3 + kv * b * rot // D                            # normed, rotated, embedded k; v
        total += T * Hq * (F32 + (b if self.gate else 0))                  # logsumexp, sigmoid(gate)
        return total

    def frozen_savings(self, hidden: int, T: int, b: int, rank: int) -> int:
        """The input norm's and the q/k norms' normalised outputs; unadapted (``rank`` 0), the
        projections' inputs (the normed input and the gated output); adapted, q, k, v, o and the
        gate each keep ``x A^T``."""
        q = T * self.heads * self.head_dim
        saved = T * hidden * F32 + T * (self.heads + self.kv_heads) * self.head_dim * F32
        if rank:
            return saved - T * rank * b * (5 if self.gate else 4)
        return saved + T * hidden * b + q * b

    def adapter_ends(self, hidden: int) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (hidden + q) + 2 * (hidden + kv) + (q + hidden) + ((hidden + self.heads) if self.gate else 0)

    def joined_ops(self, hidden: int) -> tuple[list, list]:
        """``([(in, out)] of the projections, [features] of the RMSNorms)`` per token: q, k, v,
        the head gate, o; the per-head q and k norms (``core/moe/joined_grads.py`` joins them)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        gate = [(hidden, self.heads)] if self.gate else []
        return [(hidden, q), (hidden, kv), (hidden, kv), *gate, (q, hidden)], [q, kv]

    def exchange_row_bytes(self, b: int) -> int:
        """One token's K and V: ``2 Hkv D b``."""
        return 2 * self.kv_heads * self.head_dim * b

    def key_row_bytes(self, b: int) -> int:
        return self.exchange_row_bytes(b)

    def expand_flops(self, rows) -> int:
        return 0  # K and V move as they are


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention (``core/transformer/mla.py``: DeepSeek-V3, Kimi-K2,
    Moonlight): q from ``q_proj`` or, with ``q_lora_rank``, ``q_a_proj`` -> RMSNorm ->
    ``q_b_proj``; ``kv_a_proj_with_mqa`` to a latent of ``kv_lora_rank`` and one shared rope key of
    ``qk_rope`` dims; RMSNorm -> ``kv_b_proj`` expanding the latent to every head's ``qk_nope`` key
    dims and ``v_head_dim`` value dims; ``o_proj`` from ``heads x v_head_dim``. The kernel sees
    ``heads`` query and K/V heads (K/V expanded, no weight absorption), q/k dim ``qk_nope + qk_rope``
    and value dim ``v_head_dim``; a fused kernel (flash ``varlen``, the planner's assumption) pads V
    to the q/k dim and crops its output (``core/transformer/attention.attend``). MLA attends to the
    whole causal document (no window)."""

    heads: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a plain q_proj

    window = None  # not a field: MLA families have no sliding layers

    @property
    def qk_dim(self) -> int:
        return self.qk_nope + self.qk_rope

    @property
    def padded_dim(self) -> int:
        """The head dim a kernel that needs equal q/k and v dims computes with."""
        return max(self.qk_dim, self.v_head_dim)

    @property
    def kernel(self) -> tuple:
        return self.heads, self.heads, self.qk_dim, self.v_head_dim

    def params(self, hidden: int) -> int:
        """q (plain, or its two low-rank factors), kv_a (latent + rope key), kv_b, o."""
        H, Q, C = self.heads, self.q_lora_rank, self.kv_lora_rank
        q = hidden * H * self.qk_dim if Q is None else hidden * Q + Q * H * self.qk_dim
        kv = hidden * (C + self.qk_rope) + C * H * (self.qk_nope + self.v_head_dim)
        return q + kv + H * self.v_head_dim * hidden

    def score_flops(self, keys):
        """``q.k`` at the q/k dim (nope + rope) and ``p.v`` at the value dim: counted without
        the padding a fused kernel adds to V (the model's FLOPs, not the kernel's)."""
        heads, _, qk, v = self.kernel
        return 2 * heads * (qk + v) * keys

    def flops(self, hidden: int, tokens, keys):
        return 2 * self.params(hidden) * tokens + self.score_flops(keys)

    def kept_bytes(self, hidden: int, T: int, b: int) -> int:
        """The input norm and its output (q's or q_a's and kv_a's input); the latent norms and
        q_b's input (the q latent normed), kv_b's (the normed kv latent beside the roped key,
        ``[T, kv_lora_rank + qk_rope]``: the rows CP exchanges); the kernel's q, k (the rope key expanded to every
        head) and V padded to the q/k dim, its padded output and fp32 logsumexp; o's input (a
        cropped copy when V was padded). The rotations multiply by constant cos/sin and keep
        nothing of q or k; the latent and rope key split from kv_a's output are views."""
        H, Q, C, P, Dv = self.heads, self.q_lora_rank, self.kv_lora_rank, self.padded_dim, self.v_head_dim
        total = norm_bytes(T, hidden, b) + T * hidden * b
        if Q is not None:
            total += norm_bytes(T, Q, b) + T * Q * b
        total += norm_bytes(T, C, b) + T * (C + self.qk_rope) * b
        total += 4 * T * H * P * b + (T * H * Dv * b if Dv != P else 0)
        return total + T * H * F32

    @property
    def projections(self) -> int:
        return 4 if self.q_lora_rank is None else 5

    def frozen_savings(self, hidden: int, T: int, b: int, rank: int) -> int:
        """The input norm's and the latent norms' normalised outputs; unadapted (``rank`` 0), the
        projections' inputs (the normed input, q_b's and kv_b's, o's cropped input: the kernel
        keeps its own output anyway when nothing was cropped); adapted, each projection keeps
        ``x A^T``."""
        Q, C, H, Dv = self.q_lora_rank or 0, self.kv_lora_rank, self.heads, self.v_head_dim
        saved = T * (hidden + Q + C) * F32
        if rank:
            return saved - T * rank * b * self.projections
        inputs = T * (hidden + Q + C + self.qk_rope) * b
        return saved + inputs + (T * H * Dv * b if Dv != self.padded_dim else 0)

    def adapter_ends(self, hidden: int) -> int:
        """q (or q_a and q_b), kv_a, kv_b, o (``core/finetune/lora.py`` adapts every MLA projection)."""
        H, Q, C = self.heads, self.q_lora_rank, self.kv_lora_rank
        q = hidden + H * self.qk_dim if Q is None else (hidden + Q) + (Q + H * self.qk_dim)
        kv = (hidden + C + self.qk_rope) + (C + H * (self.qk_nope + self.v_head_dim))
        return q + kv + (H * self.v_head_dim + hidden)

    def joined_ops(self, hidden: int) -> tuple[list, list]:
        """``([(in, out)] of the projections, [features] of the RMSNorms)`` per token: q (or q_a
        and q_b), kv_a, kv_b, o; the latent norms."""
        H, Q, C = self.heads, self.q_lora_rank, self.kv_lora_rank
        q = [(hidden, H * self.qk_dim)] if Q is None else [(hidden, Q), (Q, H * self.qk_dim)]
        kv = [(hidden, C + self.qk_rope), (C, H * (self.qk_nope + self.v_head_dim))]
        return [*q, *kv, (H * self.v_head_dim, hidden)], ([Q] if Q else []) + [C]

    def exchange_row_bytes(self, b: int) -> int:
        """One token's latent and rope key, ``(kv_lora_rank + qk_rope) b``: what MLA's context
        parallelism moves instead of the expanded K/V (``2 heads (qk_nope + qk_rope)`` values a
        token: 85x more on DeepSeek-V3)."""
        return (self.kv_lora_rank + self.qk_rope) * b

    def key_row_bytes(self, b: int) -> int:
        """One gathered key row as the CP attention keeps it: the latent row it expands and the K
        and V rows the kernel reads (every head's, V padded)."""
        return self.exchange_row_bytes(b) + 2 * self.heads * self.padded_dim * b

    def expand_flops(self, rows):
        """``kv_b_proj`` on ``rows`` latent rows (part of :meth:`params` per token; under CP it
        runs on the key buffer's rows instead of the rank's own tokens)."""
        return 2 * self.kv_lora_rank * self.heads * (self.qk_nope + self.v_head_dim) * rows


@dataclass(frozen=True)
class FFNShape:
    kind: str                  # "dense" (SwiGLU) or "moe"
    size: int                  # dense intermediate size, or each routed expert's
    experts: int = 0           # routed experts (all of them, before expert parallelism)
    top_k: int = 0
    shared: int = 0            # always-on shared expert's intermediate size (0: none)
    clamped: bool = False      # SwiGLU clamp on the dense MLP / routed experts
    shared_clamped: bool = False
    # Group-limited routing (DeepSeek-V3's ``n_group`` / ``topk_group``) is not a field: it only
    # restricts which experts the top-k picks among (a few comparisons over ``[T, n_group]``), so
    # every expert's GEMMs, the router's ``hidden x experts`` and the bytes below stay as they are.

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
