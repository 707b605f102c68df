"""Qwen3-MoE decoder on THD input, from core's blocks (``models/common/decoder.py``): GQA with
plain per-head q/k RMSNorm before RoPE (no attention gate), softmax top-k routed experts without
a shared expert (renormalised with ``norm_topk_prob``), dense SwiGLU on ``mlp_only_layers``, an
optional sliding window on every layer, tied or untied embeddings; numerically transformers'
``Qwen3MoeForCausalLM``. Its load-balancing loss is transformers' ``load_balancing_loss_func``
(``core.moe.aux``, scope ``model``); the routers compute in fp32 (transformers computes the
logits in the activations' dtype: equal in fp32, more precise under ``--bf16``)."""
from __future__ import annotations

from torch import nn

from core.moe.layer import MoELayer
from core.transformer.attention import Attention
from core.transformer.block import DecoderBlock
from core.transformer.mlp import SwiGLUMLP
from core.transformer.norm import RMSNorm
from models.common.decoder import DecoderLM
from models.qwen3_moe.config import Qwen3MoeConfig
from models.qwen3_moe.weights import Qwen3MoeWeights

ROPE_KEY = "default"  # one RoPE for every layer


def decoder_layer(cfg: Qwen3MoeConfig, i: int, experts: range | None = None) -> DecoderBlock:
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    attn = Attention(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, window=cfg.window,
                     softmax_scale=cfg.head_dim ** -0.5, eps=eps, backend=cfg.attention_backend,
                     gate=False, qk_norm=True, norm_offset=False, bias=cfg.attention_bias)
    if cfg.is_moe(i):
        ffn = MoELayer(H, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, 0,
                       experts=experts, score="softmax", correction_bias=False, renormalize=cfg.norm_topk_prob)
    else:
        ffn = SwiGLUMLP(H, cfg.intermediate_size)
    return DecoderBlock(RMSNorm(H, eps, offset=False), attn, RMSNorm(H, eps, offset=False), ffn,
                        ffn_name="mlp", rope_key=ROPE_KEY)


class Qwen3MoeModel(DecoderLM):
    """The Qwen3-MoE decoder, or one pipeline stage of it (see :class:`DecoderLM`)."""

    weight_adapter = Qwen3MoeWeights
    aux_scope = "model"

    def make_layer(self, i: int, experts: range | None) -> DecoderBlock:
        return decoder_layer(self.config, i, experts)

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, offset=False)

    def rope_parameters(self, key: str) -> dict:
        return self.config.rope_parameters

    @property
    def tied_head(self) -> bool:
        return self.config.tie_word_embeddings
