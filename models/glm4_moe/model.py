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

from core.transformer.attention import Attention
from models.common.nextn_decoder import NextNDecoder
from models.glm4_moe.weights import Glm4MoeWeights


class Glm4MoeModel(NextNDecoder):
    """The GLM-4.5 decoder, or one pipeline stage of it (see :class:`DecoderLM`)."""

    weight_adapter = Glm4MoeWeights

    def attention(self) -> Attention:
        cfg = self.config
        return Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         window=None, softmax_scale=cfg.head_dim ** -0.5, eps=cfg.rms_norm_eps,
                         backend=cfg.attention_backend, gate=False, qk_norm=cfg.use_qk_norm, norm_offset=False,
                         bias=cfg.attention_bias, o_bias=False)
