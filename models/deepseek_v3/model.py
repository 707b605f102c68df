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

from core.transformer.mla import MLAttention
from core.transformer.rotary import yarn_softmax_scale
from models.common.nextn_decoder import NextNDecoder
from models.deepseek_v3.weights import DeepseekV3Weights


class DeepseekV3Model(NextNDecoder):
    """The DeepSeek-V3 decoder, or one pipeline stage of it (see :class:`DecoderLM`)."""

    weight_adapter = DeepseekV3Weights

    def attention(self) -> MLAttention:
        cfg = self.config
        return MLAttention(cfg.hidden_size, cfg.num_attention_heads, q_lora_rank=cfg.q_lora_rank,
                           kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                           qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                           softmax_scale=yarn_softmax_scale(cfg.qk_head_dim ** -0.5, cfg.rope_parameters),
                           interleaved=cfg.rope_interleave, backend=cfg.attention_backend,
                           bias=cfg.attention_bias)
