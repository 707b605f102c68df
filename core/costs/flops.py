"""FLOPs of core's blocks from their shapes (``core/costs/shapes.py``): per token of each block, for
balancing pipeline stages and for the planner, and of a training step on real documents, for
TFLOP/s and MFU in the logs.

Matmuls only (2 FLOPs per multiply-add; norms, RoPE, routing top-k and the softmax are a few
percent). Attention reads ``avg_keys`` keys per query: a causal document of ``seq_length``
tokens (the worst case of a pack) and, on sliding layers, at most ``window`` keys; each attention
kind's shape (``core/costs/shapes.py``) gives its projections' weights and its score FLOPs per key
(GQA's and MLA's). Routing is the router's ``hidden x experts`` GEMM and the top-k experts' GEMMs,
group-limited or not (choosing among fewer groups changes no GEMM). Backward
costs about twice the forward everywhere, so forward FLOPs rank the stages as well as the whole
step does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from core.pipeline.balance import partition
from core.costs.shapes import BlockShape, FFNShape, ModelShapes, VisionShape, conv_out


def avg_keys(seq_length: int, window: int | None) -> float:
    """Mean number of keys a query attends to in a causal document of ``seq_length`` tokens."""
    n, w = seq_length, window or seq_length
    full = min(w, n)  # positions >= w - 1 see w keys; earlier ones see i + 1
    return (full * (full + 1) / 2 + (n - full) * w) / n


def keys_seen(n: int, window: int | None) -> int:
    """Keys summed over the queries of one causal document of ``n`` tokens."""
    w = min(window or n, n)
    return w * (w + 1) // 2 + (n - w) * w


def ffn_params(hidden: int, f: FFNShape) -> int:
    """Weights a token multiplies through: the dense SwiGLU, or router, top-k experts and the
    shared expert."""
    if not f.moe:
        return 3 * hidden * f.size
    return hidden * f.experts + f.top_k * 3 * hidden * f.size + 3 * hidden * f.shared


def block_params(hidden: int, vocab: int, b: BlockShape) -> int:
    return (b.attention.params(hidden) + ffn_params(hidden, b.ffn) + b.input_proj * hidden
            + (hidden * vocab if b.head else 0))


def attention_flops(hidden: int, a, seq_length: int) -> float:
    """Forward FLOPs per token of an attention shape (any kind): its projections, and q.k and
    p.v over the keys a query reads on average."""
    return a.flops(hidden, 1, avg_keys(seq_length, a.window))


def block_flops(hidden: int, vocab: int, b: BlockShape, seq_length: int) -> float:
    """Forward FLOPs per token of one block (its own head and input projection included)."""
    return attention_flops(hidden, b.attention, seq_length) + 2 * ffn_params(hidden, b.ffn) \
        + 2 * b.input_proj * hidden + (2 * hidden * vocab if b.head else 0)


@dataclass
class StageCosts:
    blocks: list        # per decoder layer
    first_extra: float  # the embedding (a lookup: nothing to multiply)
    last_extra: float   # final norm + head, and each extra block (projection, layer, head)
    extra: list         # per extra block, part of last_extra


def model_costs(shapes: ModelShapes, seq_length: int) -> StageCosts:
    H, V = shapes.hidden, shapes.vocab
    blocks = [block_flops(H, V, b, seq_length) for b in shapes.blocks]
    extra = [block_flops(H, V, b, seq_length) for b in shapes.extra]
    return StageCosts(blocks, 0.0, 2 * H * V + sum(extra), extra)


def balanced_layout(shapes: ModelShapes, num_stages: int, seq_length: int, first_extra: float = 0.0) -> list[int]:
    """Layers per virtual stage that minimise the slowest stage under this cost model;
    ``first_extra``: more forward FLOPs per token on the first stage (an image encoder's)."""
    c = model_costs(shapes, seq_length)
    return partition(c.blocks, num_stages, c.first_extra + first_extra, c.last_extra)


def stage_flops(shapes: ModelShapes, counts: list[int], seq_length: int) -> list[float]:
    """Forward FLOPs per token of each virtual stage of a layout."""
    c = model_costs(shapes, seq_length)
    out, start = [], 0
    for s, n in enumerate(counts):
        out.append(sum(c.blocks[start:start + n]) + (c.first_extra if s == 0 else 0.0)
                   + (c.last_extra if s == len(counts) - 1 else 0.0))
        start += n
    return out


def matmul_params_per_token(shapes: ModelShapes) -> int:
    """Weights each token multiplies through (attention projections, dense MLP or router, top-k
    routed and shared experts; the head; each extra block's projection, layer and head); the
    embedding is a lookup. Training costs 6 FLOPs per such weight and token."""
    H, V = shapes.hidden, shapes.vocab
    return sum(block_params(H, V, b) for b in shapes.blocks) + H * V + \
        sum(block_params(H, V, b) for b in shapes.extra)


def training_flops(shapes: ModelShapes, doc_lengths: list[int]) -> float:
    """Forward + backward FLOPs of one micro-batch of real documents (padding excluded):
    6 x matmul weights per token, plus 3 x each attention shape's score FLOPs over the keys its
    queries see (causal within their document, capped by the window on sliding layers; GQA:
    12 x heads x head_dim per key), over every block."""
    flops = 6.0 * matmul_params_per_token(shapes) * sum(doc_lengths)
    for b in shapes.blocks + shapes.extra:
        a = b.attention
        flops += 3.0 * a.score_flops(sum(keys_seen(n, a.window) for n in doc_lengths))
    return flops


def vit_layer_flops(v: VisionShape, n: int) -> float:
    """Forward FLOPs of one ViT block over one view of ``n`` patches: q, k, v, o and the two MLP
    matrices for every patch, and attention over all ``n`` patches of the view (bidirectional:
    ``n x n`` scores and as many weighted values, per head dimension)."""
    H = v.hidden
    return 2.0 * n * (4 * H * H + 2 * H * v.intermediate) + 4.0 * H * n * n


def vision_view_flops(v: VisionShape, size: int) -> dict:
    """Forward FLOPs of one view of ``size`` pixels, by part: the patch embedding (a convolution
    with stride = kernel: each patch's pixels times the weight), the ViT blocks, the downsamplers
    (each output position's ``in x k x k`` window times ``out`` channels; padding counted as
    multiplied) and the projector (each feature times the weight). Norms, RoPE, the layer scales
    and biases are left out, as for the decoder."""
    n, g = v.patches(size), v.grid(size)
    out = {"embedding": 2.0 * n * v.channels * v.patch ** 2 * v.hidden,
           "layers": v.depth * vit_layer_flops(v, n), "downsamplers": 0.0}
    c = v.hidden
    for o, k, s, p in v.downsamplers:
        g = conv_out(g, k, s, p)
        out["downsamplers"] += 2.0 * g * g * c * k * k * o
        c = o
    out["projector"] = 2.0 * v.features(size) * c * v.out_hidden
    return out


def vision_params(v: VisionShape) -> int:
    """Parameters of the image encoder and its projector."""
    return sum(math.prod(shape) for _, shape, _, _ in v.parameters())


# Dense bf16 peaks (TFLOP/s, no sparsity) by device name, for MFU when --peak-tflops is not given.
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0}


def device_peak_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
