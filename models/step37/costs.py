"""FLOPs of Step-3.7: per token of each part, for balancing pipeline stages, and of a training
step on real documents, for TFLOP/s and MFU in the logs.

Matmuls only (2 FLOPs per multiply-add; norms, RoPE, routing top-k and the softmax are a few
percent). Attention reads ``avg_keys`` keys per query: a causal document of ``seq_length``
tokens (the worst case of a pack) and, on sliding layers, at most ``sliding_window`` keys.
Backward costs about twice the forward everywhere, so forward FLOPs rank the stages as well
as the whole step does.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.pipeline.balance import partition
from models.step37.config import Step37Config


def avg_keys(seq_length: int, window: int | None) -> float:
    """Mean number of keys a query attends to in a causal document of ``seq_length`` tokens."""
    n, w = seq_length, window or seq_length
    full = min(w, n)  # positions >= w - 1 see w keys; earlier ones see i + 1
    return (full * (full + 1) / 2 + (n - full) * w) / n


def attention_flops(cfg: Step37Config, layer_type: str, seq_length: int) -> float:
    H, D, Hq, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads(layer_type), cfg.num_key_value_heads
    proj = H * (Hq * D + 2 * Hkv * D + Hq) + Hq * D * H  # q, k, v, head gate; o
    window = cfg.sliding_window if layer_type == "sliding_attention" else None
    core = 2 * Hq * D * avg_keys(seq_length, window)     # q.k and p.v
    return 2 * (proj + core)


def ffn_flops(cfg: Step37Config, mlp_type: str) -> float:
    H = cfg.hidden_size
    if mlp_type == "dense":
        return 2 * 3 * H * cfg.intermediate_size
    routed = cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
    return 2 * (H * cfg.num_experts + routed + 3 * H * cfg.shared_expert_size)


def head_flops(cfg: Step37Config) -> float:
    return 2 * cfg.hidden_size * cfg.vocab_size


@dataclass
class StageCosts:
    layers: list        # per decoder layer
    first_extra: float  # the embedding (a lookup: nothing to multiply)
    last_extra: float   # final norm + head, and each MTP depth (projection, layer, head)
    mtp: list           # per MTP depth, part of last_extra


def model_costs(cfg: Step37Config, seq_length: int) -> StageCosts:
    layers = [attention_flops(cfg, cfg.layer_types[i], seq_length) + ffn_flops(cfg, cfg.mlp_layer_types[i])
              for i in range(cfg.num_layers)]
    H = cfg.hidden_size
    mtp = [2 * 2 * H * H + attention_flops(cfg, cfg.mtp_layer_types[k], seq_length)
           + ffn_flops(cfg, cfg.mtp_mlp_layer_types[k]) + head_flops(cfg) for k in range(cfg.num_mtp_layers)]
    return StageCosts(layers, 0.0, head_flops(cfg) + sum(mtp), mtp)


def balanced_layout(cfg: Step37Config, num_stages: int, seq_length: int) -> list[int]:
    """Layers per virtual stage that minimise the slowest stage under this cost model."""
    c = model_costs(cfg, seq_length)
    return partition(c.layers, num_stages, c.first_extra, c.last_extra)


def stage_flops(cfg: Step37Config, counts: list[int], seq_length: int) -> list[float]:
    """Forward FLOPs per token of each virtual stage of a layout."""
    c = model_costs(cfg, seq_length)
    out, start = [], 0
    for s, n in enumerate(counts):
        out.append(sum(c.layers[start:start + n]) + (c.first_extra if s == 0 else 0.0)
                   + (c.last_extra if s == len(counts) - 1 else 0.0))
        start += n
    return out


def keys_seen(n: int, window: int | None) -> int:
    """Keys summed over the queries of one causal document of ``n`` tokens."""
    w = min(window or n, n)
    return w * (w + 1) // 2 + (n - w) * w


def matmul_params_per_token(cfg: Step37Config) -> int:
    """Weights each token multiplies through (attention projections, dense MLP or router, top-k
    routed and shared experts; head; each MTP depth's projection, layer and head); the
    embedding is a lookup. Training costs 6 FLOPs per such weight and token."""
    H, D, Hkv = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads

    def layer(layer_type: str, mlp_type: str) -> int:
        Hq = cfg.num_heads(layer_type)
        attn = H * (Hq * D + 2 * Hkv * D + Hq) + Hq * D * H
        if mlp_type == "dense":
            return attn + 3 * H * cfg.intermediate_size
        routed = cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
        return attn + H * cfg.num_experts + routed + 3 * H * cfg.shared_expert_size

    head = H * cfg.vocab_size
    total = sum(layer(cfg.layer_types[i], cfg.mlp_layer_types[i]) for i in range(cfg.num_layers)) + head
    for k in range(cfg.num_mtp_layers):
        total += 2 * H * H + layer(cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k]) + head
    return total


def training_flops(cfg: Step37Config, doc_lengths: list[int]) -> float:
    """Forward + backward FLOPs of one micro-batch of real documents (padding excluded):
    6 x matmul weights per token, plus 12 x heads x head_dim per key each query sees (causal
    within its document, capped by the window on sliding layers), over every layer and MTP depth."""
    flops = 6.0 * matmul_params_per_token(cfg) * sum(doc_lengths)
    for t in cfg.layer_types + cfg.mtp_layer_types:
        window = cfg.sliding_window if t == "sliding_attention" else None
        flops += 12.0 * cfg.num_heads(t) * cfg.head_dim * sum(keys_seen(n, window) for n in doc_lengths)
    return flops


# Dense bf16 peaks (TFLOP/s, no sparsity) by device name, for MFU when --peak-tflops is not given.
PEAK_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0}


def device_peak_tflops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
