"""Step-3.7's blocks as shapes (``core/shapes.py``): what the FLOP model, the activation-byte
model and the planner read of it. Attention is gated GQA with partial rotary on full layers;
dense layers clamp with the shared-expert limits; MoE layers have a shared expert; each MTP depth
is a decoder layer with an ``eh_proj`` input projection (2 x hidden) and its own head."""
from __future__ import annotations

from core.transformer.rotary import rotary_dim
from core.shapes import AttentionShape, BlockShape, FFNShape, ModelShapes
from models.step37.config import Step37Config


def _block(cfg: Step37Config, layer_type: str, mlp_type: str, limit, shared_limit, **extra) -> BlockShape:
    window = cfg.sliding_window if layer_type == "sliding_attention" else None
    attn = AttentionShape(cfg.num_heads(layer_type), cfg.num_key_value_heads, cfg.head_dim, window, gate=True,
                          rotary_dim=rotary_dim(cfg.head_dim, cfg.rope_parameters[layer_type]))
    if mlp_type == "dense":
        ffn = FFNShape("dense", cfg.intermediate_size, clamped=shared_limit is not None)
    else:
        ffn = FFNShape("moe", cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                       cfg.shared_expert_size, clamped=limit is not None, shared_clamped=shared_limit is not None)
    return BlockShape(attn, ffn, **extra)


def model_shapes(cfg: Step37Config) -> ModelShapes:
    blocks = tuple(_block(cfg, cfg.layer_types[i], cfg.mlp_layer_types[i], cfg.swiglu_limits[i],
                          cfg.swiglu_limits_shared[i]) for i in range(cfg.num_layers))
    extra = tuple(_block(cfg, cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k], cfg.mtp_swiglu_limits[k],
                         cfg.mtp_swiglu_limits_shared[k], input_proj=2 * cfg.hidden_size, head=True)
                  for k in range(cfg.num_mtp_layers))
    return ModelShapes(cfg.hidden_size, cfg.vocab_size, blocks, extra)
