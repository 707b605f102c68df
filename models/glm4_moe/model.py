"""GLM-4.5 decoder on THD input, from core's blocks (``models/common/decoder.py``): GQA with
q/k/v biases (``attention_bias``; ``o_proj`` has none), optional plain per-head q/k RMSNorm
(``use_qk_norm``), RoPE on the first ``head_dim * partial_rotary_factor`` dims of each head
(rotate-half); dense SwiGLU on the first ``first_k_dense_replace`` layers, then sigmoid-scored,
group-limited top-k routed experts with a correction bias (renormalised with ``norm_topk_prob``,
scaled by ``routed_scaling_factor``) plus the shared experts; plain RMSNorm everywhere;
numerically transformers' ``Glm4MoeForCausalLM``. Its ``num_nextn_predict_layers``
multi-token-prediction layers (which transformers does not build) are core's MTP block
(``core/transformer/mtp.py``), each depth a decoder layer of index ``num_layers + k`` (so MoE).
Balancing is aux-loss-free (the router's bias update); an auxiliary loss, when asked for, is the
per-layer switch form."""
from __future__ import annotations

from torch import nn

from core.moe.layer import MoELayer
from core.transformer.attention import Attention
from core.transformer.block import DecoderBlock
from core.transformer.mlp import SwiGLUMLP
from core.transformer.mtp import MTPDepth, MultiTokenPrediction
from core.transformer.norm import RMSNorm
from models.common.decoder import DecoderLM
from models.glm4_moe.config import Glm4MoeConfig
from models.glm4_moe.weights import Glm4MoeWeights

ROPE_KEY = "default"  # one (partial) RoPE for every layer


def decoder_layer(cfg: Glm4MoeConfig, i: int, experts: range | None = None) -> DecoderBlock:
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    attn = Attention(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, window=None,
                     softmax_scale=cfg.head_dim ** -0.5, eps=eps, backend=cfg.attention_backend, gate=False,
                     qk_norm=cfg.use_qk_norm, norm_offset=False, bias=cfg.attention_bias, o_bias=False)
    if cfg.is_moe(i):
        ffn = MoELayer(H, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                       cfg.shared_intermediate_size, scaling=cfg.routed_scaling_factor, experts=experts,
                       score="sigmoid", correction_bias=True, renormalize=cfg.norm_topk_prob,
                       groups=cfg.n_group, topk_groups=cfg.topk_group)
    else:
        ffn = SwiGLUMLP(H, cfg.intermediate_size)
    return DecoderBlock(RMSNorm(H, eps, offset=False), attn, RMSNorm(H, eps, offset=False), ffn,
                        ffn_name="mlp", rope_key=ROPE_KEY)


class Glm4MoeModel(DecoderLM):
    """The GLM-4.5 decoder, or one pipeline stage of it (see :class:`DecoderLM`)."""

    weight_adapter = Glm4MoeWeights

    def make_layer(self, i: int, experts: range | None) -> DecoderBlock:
        return decoder_layer(self.config, i, experts)

    def make_norm(self) -> nn.Module:
        return RMSNorm(self.config.hidden_size, self.config.rms_norm_eps, offset=False)

    def rope_parameters(self, key: str) -> dict:
        return self.config.rope_parameters

    @property
    def tied_head(self) -> bool:
        return self.config.tie_word_embeddings

    @property
    def embedding_on_last(self) -> bool:
        return self.tied_head or self.config.num_mtp_layers > 0  # MTP embeds the shifted tokens

    def build_extra(self, experts: range | None) -> None:
        cfg = self.config
        self.mtp = MultiTokenPrediction([
            MTPDepth(cfg.hidden_size, cfg.vocab_size, decoder_layer(cfg, cfg.num_layers + k, experts), self.make_norm)
            for k in range(cfg.num_mtp_layers)]) if cfg.num_mtp_layers > 0 else None
