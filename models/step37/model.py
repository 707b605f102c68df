"""Step-3.7 text decoder on THD input, from core's blocks (``models/common/decoder.py``): gated
GQA with per-head ``(1 + w)`` q/k norms, sliding and full layers with their own RoPE, dense
SwiGLU or sigmoid-routed MoE with a shared expert, SwiGLU clamps, multi-token prediction
(``core/transformer/mtp.py``; each depth's decoder block has its own layer type, FFN and clamps).

With a vision tower in the config (Step-3.7 VLM), the first stage (the chunk with the input
embedding) also holds ``vision_model`` and ``multi_modal_projector`` (``models/step37/vision.py``)
and, given a micro-batch's ``images``, writes their projected features over the embeddings of
the image placeholders. A first-stage micro-batch without images does not run the tower, unless
it gets an idle ``ImageInputs`` (``ImageInputs.idle()``: another data-parallel rank has images
this step): then the tower runs once on a zero 5 x 5-patch image whose features are written
nowhere (``vision.idle_pass``), its logits unchanged bit for bit, so that every data-parallel
rank runs the same FSDP collectives for the tower's units whether its micro-batch has images or
not (``core/train_step.py`` decides).
"""
from __future__ import annotations

import torch
from torch import nn

from core.model_api import FSDPUnit, ParamSpec
from core.moe.layer import MoELayer
from core.transformer.attention import Attention
from core.transformer.block import DecoderBlock
from core.transformer.mlp import SwiGLUMLP
from core.transformer.mtp import MTPDepth, MultiTokenPrediction
from core.transformer.norm import RMSNorm
from core.transformer.vit import BiasedLinear
from models.common.decoder import DecoderLM
from models.step37.config import Step37Config
from models.step37.vision import VisionTower, idle_pass, image_features, write_features
from models.step37.weights import Step37Weights

VISION, PROJECTOR = "vision_model", "multi_modal_projector"
# AdamW, not a matrix optimizer: the patch and position embeddings and the 4-D convolution kernels
_VISION_ADAMW = ("patch_embed.weight", "pos_embed", "downsample1.weight", "downsample2.weight")


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

    # ------------------------------------------------------------------ vision (first stage)
    def _build(self, own: list, first: bool, last: bool, experts: range | None) -> None:
        super()._build(own, first, last, experts)
        cfg = self.config
        self.vision_model = VisionTower(cfg.vision) if first and cfg.vision is not None else None
        self.multi_modal_projector = BiasedLinear(cfg.vision.out_size, cfg.hidden_size, bias=cfg.projector_bias) \
            if self.vision_model is not None else None

    def embed(self, tokens: torch.Tensor, images=None) -> torch.Tensor:
        if self.vision_model is None:
            return super().embed(tokens, images)
        x = self.embed_tokens(tokens)
        if images is None:  # no rank of the data-parallel group has an image: no tower
            return x
        if images.is_idle:  # another rank has: the tower's collectives, no feature written
            return idle_pass(self.vision_model, self.multi_modal_projector, x)
        feats = image_features(self.vision_model, self.multi_modal_projector, images)
        return write_features(x, feats, images)

    def param_specs(self) -> dict[str, ParamSpec]:
        specs = super().param_specs()
        for name in specs:
            if name.startswith(VISION + ".") and name.endswith(_VISION_ADAMW) and specs[name].role == "weight":
                specs[name] = ParamSpec(role="embedding")
        return specs

    def fsdp_units(self) -> list[FSDPUnit]:
        """Each vision layer a unit, then the tower (patch and position embeddings, downsamplers),
        the projector, then the decoder's units. The projector is not left to the root: the root
        is released once the heads' backward is done (``core/model_api.py``), and the projector's
        backward, which reads its weight, comes after the whole trunk's."""
        units = []
        if self.vision_model is not None:
            units = [FSDPUnit(b, "dp") for b in self.vision_model.blocks] + [
                FSDPUnit(self.vision_model, "dp"), FSDPUnit(self.multi_modal_projector, "dp")]
        return units + super().fsdp_units()

    def image_parameters(self) -> list[nn.Parameter]:
        """Projector, vision layers last to first, then the tower's own (patch and position
        embeddings, norm, downsamplers): the order FSDP finishes their units' gradients in a
        backward (``fsdp_units``, reversed), each unit's parameters in their own order."""
        if self.vision_model is None:
            return []
        tower = self.vision_model
        in_layers = {id(p) for p in tower.blocks.parameters()}
        return [*self.multi_modal_projector.parameters(),
                *(p for block in reversed(tower.blocks) for p in block.parameters()),
                *(p for p in tower.parameters() if id(p) not in in_layers)]

    def param_parts(self) -> dict[str, list[str]]:
        """Parameter names by part, for freezing one: ``vision`` (tower and downsamplers),
        ``projector``, ``language`` (everything else: embeddings, decoder, heads, MTP). Each FSDP
        unit (``fsdp_units``, the root included) holds parameters of one part only."""
        parts = {"vision": [], "projector": [], "language": []}
        for name, _ in self.named_parameters():
            part = "vision" if name.startswith(VISION + ".") else \
                "projector" if name.startswith(PROJECTOR + ".") else "language"
            parts[part].append(name)
        return parts

    def build_extra(self, experts: range | None) -> None:
        cfg = self.config  # each depth's own decoder block (layer type, FFN, clamps)
        self.mtp = MultiTokenPrediction([
            MTPDepth(cfg.hidden_size, cfg.vocab_size,
                     decoder_layer(cfg, cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k], cfg.mtp_swiglu_limits[k],
                                   cfg.mtp_swiglu_limits_shared[k], experts), self.make_norm)
            for k in range(cfg.num_mtp_layers)]) if cfg.num_mtp_layers > 0 else None
