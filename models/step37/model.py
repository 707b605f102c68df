"""Step-3.7 text decoder on THD input, from core's blocks (``models/common/decoder.py``): gated
GQA with per-head ``(1 + w)`` q/k norms, sliding and full layers with their own RoPE, dense
SwiGLU or sigmoid-routed MoE with a shared expert, SwiGLU clamps, multi-token prediction
(``core/transformer/mtp.py``; each depth's decoder block has its own layer type, FFN and clamps).
"""
from __future__ import annotations

from torch import nn

from core.moe.layer import MoELayer
from core.transformer.attention import Attention
from core.transformer.block import DecoderBlock
from core.transformer.mlp import SwiGLUMLP
from core.transformer.mtp import MTPDepth, MultiTokenPrediction
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
        cfg = self.config  # each depth's own decoder block (layer type, FFN, clamps)
        self.mtp = MultiTokenPrediction([
            MTPDepth(cfg.hidden_size, cfg.vocab_size,
                     decoder_layer(cfg, cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k], cfg.mtp_swiglu_limits[k],
                                   cfg.mtp_swiglu_limits_shared[k], experts), self.make_norm)
            for k in range(cfg.num_mtp_layers)]) if cfg.num_mtp_layers > 0 else None
