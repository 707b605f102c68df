"""Activation bytes autograd keeps per decoder layer and per output head, for one micro-batch of
T tokens, derived from what our layers save for backward (see the comments; the unit tests hold
the formula within 25% of a measurement with ``core.memory.SavedTensorBytes``).

``b`` is the activation dtype size; norms, softmax statistics, the router and the loss keep fp32.
"""
from __future__ import annotations

from models.step37.config import Step37Config

F32 = 4


def norm_bytes(T: int, n: int, b: int) -> int:
    # fp32 input (a copy when b < 4, the input itself in fp32), normalised fp32 output, 1/rms
    return 2 * T * n * F32 + T * F32


def swiglu_bytes(T: int, inter: int, b: int, clamped: bool) -> int:
    # gate, silu(gate), up, product (+ the two clamp outputs when clamped)
    return T * inter * b * (6 if clamped else 4)


def attention_bytes(cfg: Step37Config, layer_type: str, T: int, b: int) -> int:
    D, Hq, Hkv = cfg.head_dim, cfg.num_heads(layer_type), cfg.num_key_value_heads
    rot = int(D * cfg.rope_parameters[layer_type].get("partial_rotary_factor", 1.0))
    q = T * Hq * D
    kv = T * Hkv * D
    total = norm_bytes(T, cfg.hidden_size, b) + T * cfg.hidden_size * b   # input norm + its output
    total += norm_bytes(T, Hq * D, b) + norm_bytes(T, Hkv * D, b)        # q_norm, k_norm
    total += q * b * 5 + q * b * rot // D                                  # normed, rotated, embedded q; output, gated
    total += kv * b * 3 + kv * b * rot // D                                # normed, rotated, embedded k; v
    total += T * Hq * (F32 + b)                                            # logsumexp, sigmoid(gate)
    return total


def ffn_bytes(cfg: Step37Config, mlp_type: str, T: int, b: int, limit, shared_limit) -> int:
    H = cfg.hidden_size
    total = norm_bytes(T, H, b) + T * H * b  # post-attention norm and its output
    if mlp_type == "dense":
        return total + swiglu_bytes(T, cfg.intermediate_size, b, shared_limit is not None)
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    total += 3 * T * E * F32 + 2 * T * K * F32                   # router scores, probabilities, weights
    total += T * K * H * b * 2                                   # permuted tokens, expert outputs
    total += swiglu_bytes(T * K, cfg.moe_intermediate_size, b, limit is not None)
    total += swiglu_bytes(T, cfg.shared_expert_size, b, shared_limit is not None)
    return total


def layer_bytes(cfg: Step37Config, layer: int, T: int, b: int, recompute: str = "none") -> int:
    """Bytes kept between forward and backward by decoder layer ``layer`` (``-1-k``: MTP depth k)."""
    if layer >= 0:
        lt, mt = cfg.layer_types[layer], cfg.mlp_layer_types[layer]
        lim, slim = cfg.swiglu_limits[layer], cfg.swiglu_limits_shared[layer]
    else:
        k = -1 - layer
        lt, mt = cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k]
        lim, slim = cfg.mtp_swiglu_limits[k], cfg.mtp_swiglu_limits_shared[k]
    if recompute == "full":
        return T * cfg.hidden_size * b  # the layer input only
    if recompute == "selective":  # norms, their outputs and the residual stream stay
        return 2 * (norm_bytes(T, cfg.hidden_size, b) + T * cfg.hidden_size * b)
    return attention_bytes(cfg, lt, T, b) + ffn_bytes(cfg, mt, T, b, lim, slim)


def head_bytes(cfg: Step37Config, T: int, b: int) -> int:
    """Final norm and its output, and the fp32 log-probabilities the cross-entropy keeps."""
    return norm_bytes(T, cfg.hidden_size, b) + T * cfg.hidden_size * b + T * cfg.vocab_size * F32


def cpu_sdpa_extra_bytes(cfg: Step37Config, layer_type: str, doc_lengths: list, b: int) -> int:
    """What the CPU ``sdpa`` backend (``core/transformer/sdpa_blocks.py``) keeps on top of a
    fused (GPU) kernel, for documents laid end to end without padding. Its calls run torch's
    fused CPU kernel (logsumexp, no score matrix), but a band piece saves padded copies of q,
    k and v (``blocks * block`` queries; ``width - 1`` more keys) instead of q, k, v, and its
    additive mask ``[blocks, block, block + width - 1]``, one per micro-batch and window: each
    layer books its share among the layers of its type. The kernel's output is saved apart
    from the ``[T, H, D]`` copy the gate multiplies (unless that is a view of it)."""
    from core.transformer.sdpa_blocks import plan_pieces

    H, Hkv, D = cfg.num_heads(layer_type), cfg.num_key_value_heads, cfg.head_dim
    window = cfg.sliding_window if layer_type == "sliding_attention" else None
    starts = [sum(doc_lengths[:i]) for i in range(len(doc_lengths))]
    T = sum(doc_lengths)
    pieces = plan_pieces(starts, T, window)
    sharing = (cfg.layer_types + cfg.mtp_layer_types).count(layer_type)
    total = 0 if len(pieces) == 1 and pieces[0].kind == "causal" else T * H * D * b
    for p in pieces:
        if p.kind == "band":
            n = p.stop - p.start
            rows = -(-n // p.block) * p.block
            lookback = 0 if p.block == n else p.width - 1
            total += (rows - n) * H * D * b + 2 * (rows + lookback - n) * Hkv * D * b
            total += rows * (p.block + lookback) * b // sharing
    return total
