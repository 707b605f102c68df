"""Step-3.7 text decoder on THD input, from core's blocks (``models/common/decoder.py``): gated
GQA with per-head ``(1 + w)`` q/k norms, sliding and full layers with their own RoPE, dense
SwiGLU or sigmoid-routed MoE with a shared expert, SwiGLU clamps, multi-token prediction.

Multi-token prediction, depth k = 1..D (DeepSeek-V3 style): ``h_k = block_k(eh_proj([enorm(
embed(x shifted by k)), hnorm(h_{k-1})]))`` with ``h_0`` the main model's last hidden state
before the final norm, and depth k's logits at position t predict token t + k + 1. Shifts stay
inside each document: a position whose shifted input or target would come from the next
document gets padding and no target. Each depth's head computes its loss a tile at a time
(``core/loss.py``: no ``[T, vocab]`` logits); under ``--recompute-granularity full`` everything
of a depth before its head is recomputed in the backward (the depth keeps its inputs and its
head's input), under ``selective`` its decoder block drops its internals.
"""
from __future__ import annotations

import torch
from torch import nn

from core.loss import IGNORE_INDEX, linear_cross_entropy
from core.moe.layer import MoELayer
from core.transformer.attention import Attention
from core.transformer.attention_backends import DocLayout
from core.transformer.block import DecoderBlock, RecomputeUnit
from core.transformer.mlp import SwiGLUMLP
from core.transformer.norm import RMSNorm
from models.common.decoder import DecoderLM
from models.step37.config import Step37Config
from models.step37.weights import Step37Weights


def decoder_layer(cfg: Step37Config, layer_type: str, mlp_type: str, limit: float | None,
                  shared_limit: float | None, experts: range | None = None) -> DecoderBlock:
    H = cfg.hidden_size
    attn = Attention(H, cfg.num_heads(layer_type), cfg.num_key_value_heads, cfg.head_dim,
                     window=cfg.sliding_window if layer_type == "sliding_attention" else None,
                     softmax_scale=cfg.query_pre_attn_scalar ** -0.5, eps=cfg.rms_norm_eps,
                     backend=cfg.attention_backend, gate=True, qk_norm=True, norm_offset=True)
    if mlp_type == "dense":  # Step-3.x clamps dense layers with the shared-expert limits
        ffn, name = SwiGLUMLP(H, cfg.intermediate_size, shared_limit), "mlp"
    else:
        ffn, name = MoELayer(H, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                             cfg.shared_expert_size, scaling=cfg.moe_router_scaling_factor, limit=limit,
                             shared_limit=shared_limit, experts=experts, score="sigmoid",
                             correction_bias=True, renormalize=True), "moe"
    return DecoderBlock(RMSNorm(H, cfg.rms_norm_eps), attn, RMSNorm(H, cfg.rms_norm_eps), ffn,
                        ffn_name=name, rope_key=layer_type)


class MTPDepth(RecomputeUnit):
    def __init__(self, cfg: Step37Config, k: int, experts: range | None = None):
        super().__init__()
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = decoder_layer(cfg, cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k],
                                   cfg.mtp_swiglu_limits[k], cfg.mtp_swiglu_limits_shared[k], experts)
        self.head_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.head = nn.Linear(H, cfg.vocab_size, bias=False)

    def forward(self, emb_TH, h_prev_TH, ropes, layout, valid_T, labels_T):
        """(hidden state for the next depth, this depth's summed token loss and target count,
        MoE statistics or None). The head runs inside the forward so a wrapper that gathers this
        module's weights (FSDP) covers it; it stays outside the recomputed part, whose rerun
        would otherwise add a pass over the vocabulary to the one the loss's backward makes."""
        h, h_norm, stats = self.recomputed(self._trunk, emb_TH, h_prev_TH, ropes, layout, valid_T)
        loss, count = linear_cross_entropy(h_norm, self.head.weight, labels_T)
        return h, loss, count, stats

    def _trunk(self, emb_TH, h_prev_TH, ropes, layout, valid_T):
        x = self.eh_proj(torch.cat([self.enorm(emb_TH), self.hnorm(h_prev_TH)], dim=-1))
        h, stats = self.block(x, ropes, layout, valid_T)
        return h, self.head_norm(h), stats


class Step37Model(DecoderLM):
    """The Step-3.7 decoder, or one pipeline stage of it (see :class:`DecoderLM`)."""

    weight_adapter = Step37Weights
    aux_scope = "layer"

    @property
    def router_fp32(self) -> bool:
        return self.config.need_fp32_gate  # the published need_fp32_gate

    def make_layer(self, i: int, experts: range | None) -> DecoderBlock:
        c = self.config
        return decoder_layer(c, c.layer_types[i], c.mlp_layer_types[i], c.swiglu_limits[i],
                             c.swiglu_limits_shared[i], experts)

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    def rope_parameters(self, key: str) -> dict:
        return self.config.rope_parameters[key]

    @property
    def embedding_on_last(self) -> bool:
        return self.config.num_mtp_layers > 0  # MTP feeds shifted token embeddings

    def build_extra(self, experts: range | None) -> None:
        cfg = self.config
        self.mtp = nn.ModuleDict({str(k): MTPDepth(cfg, k, experts) for k in range(cfg.num_mtp_layers)}) \
            if cfg.num_mtp_layers > 0 else None

    def extra_blocks(self) -> list[tuple[int, nn.Module]]:
        mtp = getattr(self, "mtp", None)
        return [(-1 - int(k), d) for k, d in mtp.items()] if mtp is not None else []

    def extra_heads(self) -> list[nn.Module]:
        return [d.head for _, d in self.extra_blocks()]

    def extra_losses(self, out, stats, h, tokens, labels, ropes, layout, valid) -> None:
        if getattr(self, "mtp", None) is None:
            return
        nxt, ok = _next_in_document(layout, tokens.device)
        shifted_tokens, shifted_labels = tokens, labels
        for k, depth in enumerate(self.mtp.values(), start=1):
            shifted_tokens = torch.where(ok, shifted_tokens[nxt], torch.zeros_like(tokens))
            shifted_labels = torch.where(ok, shifted_labels[nxt], torch.full_like(labels, IGNORE_INDEX))
            h, loss, n, s = depth(self.embed_tokens(shifted_tokens), h, ropes, layout, valid, shifted_labels)
            stats += [s] if s is not None else []
            out.mtp_loss_sums.append(loss)
            out.mtp_num_tokens.append(n)


def _next_in_document(layout: DocLayout, device):
    """Index of the next position and whether it is a real token of the same document, computed
    on ``device`` from the layout's device boundaries (no host-to-device copy mid-forward)."""
    T = layout.total
    idx = torch.arange(1, T + 1, device=device)
    return idx.clamp(max=T - 1), idx < layout.real_end(device)
