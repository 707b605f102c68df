"""Activation bytes autograd keeps per block and per output head, for one micro-batch of T
tokens, derived from what core's blocks save for backward (see the comments; the unit tests hold
the formula within 25% of a measurement with ``core.costs.saved_bytes.SavedTensorBytes``).

``b`` is the activation dtype size; norms, softmax statistics, the router and the loss keep fp32.
Attention assumes a fused kernel (flash / flex / Transformer Engine: no score matrix); what the
CPU's SDPA keeps on top is :func:`cpu_sdpa_extra_bytes`. What an attention keeps is its shape's
(``kept_bytes``, ``frozen_savings`` of the protocol in ``core/costs/shapes.py``: GQA, MLA); the recompute
modes keep the same for every kind (:func:`block_bytes`).
"""
from __future__ import annotations

from core.costs.shapes import F32, BlockShape, FFNShape, ModelShapes, VisionShape, conv_out, norm_bytes


def swiglu_bytes(T: int, inter: int, b: int, clamped: bool) -> int:
    # gate, silu(gate), up, product (+ the two clamp outputs when clamped)
    return T * inter * b * (6 if clamped else 4)


def attention_bytes(hidden: int, a, T: int, b: int) -> int:
    """The attention half of a block (its input norm included), of any attention kind."""
    return a.kept_bytes(hidden, T, b)


def ffn_bytes(hidden: int, f: FFNShape, T: int, b: int) -> int:
    H = hidden
    total = norm_bytes(T, H, b) + T * H * b  # post-attention norm and its output
    if not f.moe:
        return total + swiglu_bytes(T, f.size, b, f.clamped)
    E, K = f.experts, f.top_k
    total += 3 * T * E * F32 + 2 * T * K * F32                   # router scores, probabilities, weights
    total += T * K * H * b * 2                                   # permuted tokens, expert outputs
    total += swiglu_bytes(T * K, f.size, b, f.clamped)
    if f.shared:
        total += swiglu_bytes(T, f.shared, b, f.shared_clamped)
    return total


def frozen_savings(hidden: int, s: BlockShape, T: int, b: int, lora: tuple) -> int:
    """What a block keeps less when its base is frozen (LoRA: ``lora`` is ``(rank, targets)``,
    ``core/finetune/lora.py``), and what its adapters keep more. autograd saves a matmul's input only for
    its weight's gradient and a norm's normalised output only for its scale's, so a frozen norm
    drops that fp32 output, and a frozen projection with no adapter drops its input: the
    attention's (its shape's ``frozen_savings``: GQA's normed input and gated output, MLA's
    normed input, normed latents and o's input; all its projections adapted together under
    ``attention``), the FFN's normed input (a routed expert's copy of it, the permuted tokens,
    too) and each SwiGLU's product (the down projection's input). An adapted projection keeps
    its input (the adapter's A needs it) and ``x A^T`` (``T x rank``, for B's gradient). The
    first layers before any adapter keep even less (nothing there requires a gradient): not
    counted, an overestimate by at most a layer. Dropout's mask (``--lora-dropout``) is not
    counted."""
    rank, targets = lora[0], {t.strip() for t in lora[1].split(",")} if isinstance(lora[1], str) else set(lora[1])
    f, H = s.ffn, hidden
    saved = T * H * F32  # the post-attention norm's output
    saved += s.attention.frozen_savings(H, T, b, rank if "attention" in targets else 0)
    adapted_ffn = ("mlp" in targets) if not f.moe else bool({"shared_expert", "experts"} & set(targets))
    if not adapted_ffn:
        saved += T * H * b
    if not f.moe:
        saved += T * f.size * b if "mlp" not in targets else -3 * T * rank * b
        return saved
    K = f.top_k
    saved += T * K * (H + f.size) * b if "experts" not in targets else -3 * T * K * rank * b
    if f.shared:
        saved += T * f.shared * b if "shared_expert" not in targets else -3 * T * rank * b
    return saved


def block_bytes(shapes: ModelShapes, block: int, T: int, b: int, recompute: str = "none",
                lora: tuple = ()) -> int:
    """Bytes kept between forward and backward by decoder layer ``block`` (``-1-k``: extra block
    k), its own head and input projection excluded (see :func:`extra_block_bytes`); ``lora``:
    ``(rank, targets)`` of a frozen base with adapters (:func:`frozen_savings`)."""
    H = shapes.hidden
    if recompute == "full":
        return T * H * b  # the layer input only
    if recompute == "selective":  # norms, their outputs and the residual stream stay
        return 2 * (norm_bytes(T, H, b) + T * H * b)
    s: BlockShape = shapes.block(block)
    kept = attention_bytes(H, s.attention, T, b) + ffn_bytes(H, s.ffn, T, b)
    return kept - frozen_savings(H, s, T, b, lora) if lora else kept


def loss_bytes(T: int) -> int:
    # the chunked cross-entropy (core/loss.py): an fp32 logsumexp and the int64 label per token
    return T * (F32 + 8)


def head_bytes(shapes: ModelShapes, T: int, b: int) -> int:
    """Final norm and its output (the head's input), and what the chunked cross-entropy keeps:
    no logits, an fp32 logsumexp and the label per token."""
    return norm_bytes(T, shapes.hidden, b) + T * shapes.hidden * b + loss_bytes(T)


def extra_block_bytes(shapes: ModelShapes, k: int, T: int, b: int, recompute: str = "none",
                      lora: tuple = ()) -> int:
    """Extra block ``k``: its layer, its head, and for an input projection the shifted embedding
    and the projection's input. Under ``full`` recompute everything before its head reruns
    (``core.transformer.block.RecomputeUnit``): only that part's inputs (the shifted embedding,
    the previous hidden state) stay, with the head's input and its loss's per-token values;
    under ``selective`` its layer keeps what a selective decoder layer keeps."""
    s, H = shapes.extra[k], shapes.hidden
    if recompute == "full":
        total = T * H * b * (2 if s.input_proj else 1)
        return total + (T * H * b + loss_bytes(T) if s.head else 0)
    total = block_bytes(shapes, -1 - k, T, b, recompute, lora)
    if s.head:
        total += head_bytes(shapes, T, b)
    if s.input_proj:  # a frozen projection (never adapted) drops its concatenated input
        total += T * H * b if lora else 3 * T * H * b
    return total


def layer_norm_bytes(T: int, n: int, b: int) -> int:
    # torch's layer norm (fp32 under autocast): its fp32 input, mean and 1/std (no normalised output)
    return T * n * F32 + 2 * T * F32


def vit_layer_bytes(v: VisionShape, n: int, b: int, recompute: str = "none") -> int:
    """Bytes one ViT block keeps for one view of ``n`` patches. ``none``: both LayerNorms (fp32
    input and statistics) and their outputs (the inputs of q, k, v and of fc1); rotated q and k, v, the fused kernel's
    output (o's input) and fp32 logsumexp; o's and fc2's outputs (the layer scales' inputs); fc1's
    output, its quick-GELU's sigmoid and product (fc2's input). ``selective``: as a decoder layer,
    the norms, their outputs and the residual stream. ``full``: the block's input only."""
    H = v.hidden
    if recompute == "full":
        return n * H * b
    if recompute == "selective":
        return 2 * (layer_norm_bytes(n, H, b) + n * H * b)
    return 2 * layer_norm_bytes(n, H, b) + 8 * n * H * b + n * v.heads * F32 + 3 * n * v.intermediate * b


def vision_view_bytes(v: VisionShape, size: int, b: int, recompute: str = "none", trained: str = "all") -> int:
    """Bytes the image encoder keeps for one view of ``size`` pixels until its backward.
    ``trained``: ``"all"`` (every weight learns), ``"projector"`` (the tower frozen: nothing
    before the projector requires a gradient, so only the projector's input stays) or ``"none"``
    (LoRA: nothing of it learns, nothing stays). A trained tower keeps the pixels (the patch
    embedding's input), the pre-norm, each block as :func:`vit_layer_bytes` under ``recompute``
    (``full``: each block's input; the blocks rerun in the backward), each downsampler's input and
    the projector's input (these last four the same in every recompute mode)."""
    g = v.grid(size)
    c, proj_in = v.hidden, 0
    for o, k, s, p in v.downsamplers:
        g = conv_out(g, k, s, p)
        c = o
    proj_in = g * g * c * b
    if trained == "none":
        return 0
    if trained == "projector":
        return proj_in
    n, H = v.patches(size), v.hidden
    total = n * v.channels * v.patch ** 2 * b + layer_norm_bytes(n, H, b)
    total += v.depth * vit_layer_bytes(v, n, b, recompute)
    g, c = v.grid(size), H
    for o, k, s, p in v.downsamplers:
        total += g * g * c * b
        g, c = conv_out(g, k, s, p), o
    return total + proj_in


def cpu_sdpa_extra_bytes(a, doc_lengths: list, b: int, sharing: int = 1) -> int:
    """What the CPU ``sdpa`` backend (``core/transformer/sdpa_blocks.py``) keeps on top of a
    fused (GPU) kernel, for documents laid end to end without padding, for an attention shape of
    any kind (its ``kernel`` dims). Its calls run torch's fused CPU kernel (logsumexp, no score
    matrix), but a band piece saves padded copies of q, k and v (``blocks * block`` queries;
    ``width - 1`` more keys) instead of q, k, v, and its additive mask ``[blocks, block, block +
    width - 1]``, one per micro-batch and window: each of the ``sharing`` layers with this window
    books its share. The kernel's output is saved apart from the ``[T, H, Dv]`` copy the gate
    multiplies (unless that is a view of it). A value dim other than the q/k dim (MLA) takes
    torch's math path on CPU, which keeps every score matrix, unless V is padded to the q/k dim
    as for a fused GPU kernel: counted here as padded (``tests/unit/test_mla_costs.py`` forces
    the padding)."""
    from core.transformer.sdpa_blocks import plan_pieces

    H, Hkv, D, Dv = a.kernel
    starts = [sum(doc_lengths[:i]) for i in range(len(doc_lengths))]
    T = sum(doc_lengths)
    pieces = plan_pieces(starts, T, a.window)
    total = 0 if len(pieces) == 1 and pieces[0].kind == "causal" else T * H * Dv * b
    for p in pieces:
        if p.kind == "band":
            n = p.stop - p.start
            rows = -(-n // p.block) * p.block
            lookback = 0 if p.block == n else p.width - 1
            total += (rows - n) * H * D * b + (rows + lookback - n) * Hkv * (D + Dv) * b
            total += rows * (p.block + lookback) * b // sharing
    return total
