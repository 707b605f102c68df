"""The decoder DeepSeek-V3 introduced and GLM-4.5 kept, from core's blocks
(``models/common/decoder.py``); a family gives only its attention module (:meth:`attention`) and
its config. Dense SwiGLU on the first ``first_k_dense_replace`` layers, then sigmoid-scored,
group-limited top-k routed experts with a correction bias (renormalised with ``norm_topk_prob``,
scaled by ``routed_scaling_factor``) plus the shared experts (one SwiGLU of their summed size);
plain RMSNorm everywhere; one RoPE for every layer. ``num_nextn_predict_layers``
multi-token-prediction depths follow the last layer (``core/transformer/mtp.py``; transformers
builds none): each a decoder layer of index ``num_layers + k`` of the published layout (MoE on
the releases) between core's ``enorm`` / ``hnorm`` / ``eh_proj`` and its own head, embedding with
the main input embedding. They change no main logit. Balancing is aux-loss-free (the router's
bias update); an auxiliary loss, when asked for, is the per-layer switch form. Weight names:
``models/common/nextn_layout.py``."""
from __future__ import annotations

from torch import nn

from core.moe.layer import MoELayer
from core.transformer.block import DecoderBlock
from core.transformer.mlp import SwiGLUMLP
from core.transformer.mtp import MTPDepth, MultiTokenPrediction
from core.transformer.norm import RMSNorm
from models.common.decoder import DecoderLM
from models.common.nextn_layout import NextNLayout

ROPE_KEY = "default"  # one RoPE for every layer


class NextNDecoder(DecoderLM):
    """A DeepSeek-V3-layout decoder, or one pipeline stage of it (see :class:`DecoderLM`)."""

    weight_adapter = NextNLayout

    def attention(self) -> nn.Module:
        """The family's attention module for one layer (every layer has the same)."""
        raise NotImplementedError

    def decoder_layer(self, i: int, experts: range | None = None) -> DecoderBlock:
        cfg = self.config
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.is_moe(i):
            ffn = MoELayer(H, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                           cfg.shared_intermediate_size, scaling=cfg.routed_scaling_factor, experts=experts,
                           score="sigmoid", correction_bias=True, renormalize=cfg.norm_topk_prob,
                           groups=cfg.n_group, topk_groups=cfg.topk_group)
        else:
            ffn = SwiGLUMLP(H, cfg.intermediate_size)
        return DecoderBlock(RMSNorm(H, eps, offset=False), self.attention(), RMSNorm(H, eps, offset=False), ffn,
                            ffn_name="mlp", rope_key=ROPE_KEY)

    def make_layer(self, i: int, experts: range | None) -> DecoderBlock:
        return self.decoder_layer(i, experts)

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
            MTPDepth(cfg.hidden_size, cfg.vocab_size, self.decoder_layer(cfg.num_layers + k, experts), self.make_norm)
            for k in range(cfg.num_mtp_layers)]) if cfg.num_mtp_layers > 0 else None
