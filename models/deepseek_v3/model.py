"""DeepSeek-V3 decoder on THD input, from core's blocks (``models/common/decoder.py``): multi-head
latent attention (``core/transformer/mla.py``), dense SwiGLU on the first
``first_k_dense_replace`` layers, then sigmoid-scored, group-limited top-k routed experts with a
correction bias (renormalised with ``norm_topk_prob``, scaled by ``routed_scaling_factor``) plus
the shared experts; plain RMSNorm everywhere; numerically transformers'
``DeepseekV3ForCausalLM``. ``num_nextn_predict_layers`` multi-token-prediction depths follow the
last layer (``core/transformer/mtp.py``; transformers builds none): each a decoder layer of index
``num_layers + k`` (MoE on the release) between core's ``enorm`` / ``hnorm`` / ``eh_proj`` and its
own head; the input embedding is the main one (DeepSeek-V3 shares it), the head a tensor of its
own (``docs/deepseek-v3.md``). They change no main logit. Balancing is aux-loss-free (the
router's bias update); an auxiliary loss, when asked for, is the per-layer switch form."""
from __future__ import annotations

from torch import nn

from core.moe.layer import MoELayer
from core.transformer.block import DecoderBlock
from core.transformer.mla import MLAttention
from core.transformer.mlp import SwiGLUMLP
from core.transformer.mtp import MTPDepth, MultiTokenPrediction
from core.transformer.norm import RMSNorm
from core.transformer.rotary import yarn_softmax_scale
from models.common.decoder import DecoderLM
from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.weights import DeepseekV3Weights

ROPE_KEY = "default"  # one RoPE (over qk_rope_head_dim) for every layer


def attention(cfg: DeepseekV3Config) -> MLAttention:
    return MLAttention(cfg.hidden_size, cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                       kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                       qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                       softmax_scale=yarn_softmax_scale(cfg.qk_head_dim ** -0.5, cfg.rope_parameters),
                       interleaved=cfg.rope_interleave, backend=cfg.attention_backend, bias=cfg.attention_bias)


def decoder_layer(cfg: DeepseekV3Config, i: int, experts: range | None = None) -> DecoderBlock:
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    if cfg.is_moe(i):
        ffn = MoELayer(H, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                       cfg.shared_intermediate_size, scaling=cfg.routed_scaling_factor, experts=experts,
                       score="sigmoid", correction_bias=True, renormalize=cfg.norm_topk_prob,
                       groups=cfg.n_group, topk_groups=cfg.topk_group)
    else:
        ffn = SwiGLUMLP(H, cfg.intermediate_size)
    return DecoderBlock(RMSNorm(H, eps, offset=False), attention(cfg), RMSNorm(H, eps, offset=False), ffn,
                        ffn_name="mlp", rope_key=ROPE_KEY)


class DeepseekV3Model(DecoderLM):
    """The DeepSeek-V3 decoder, or one pipeline stage of it (see :class:`DecoderLM`)."""

    weight_adapter = DeepseekV3Weights

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
        cfg = self.config  # depth k's decoder layer is layer num_layers + k of the published layout
        self.mtp = MultiTokenPrediction([
            MTPDepth(cfg.hidden_size, cfg.vocab_size, decoder_layer(cfg, cfg.num_layers + k, experts), self.make_norm)
            for k in range(cfg.num_mtp_layers)]) if cfg.num_mtp_layers > 0 else None
