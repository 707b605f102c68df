"""Qwen3-MoE's blocks as shapes (``core/costs/shapes.py``): ungated GQA with full rotary on every
layer (a window when ``use_sliding_window``), dense SwiGLU or routed experts without a shared one."""
from __future__ import annotations

from core.costs.shapes import AttentionShape, BlockShape, FFNShape, ModelShapes
from core.transformer.rotary import rotary_dim
from models.qwen3_moe.config import Qwen3MoeConfig


def model_shapes(cfg: Qwen3MoeConfig) -> ModelShapes:
    attn = AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.window,
                          gate=False, rotary_dim=rotary_dim(cfg.head_dim, cfg.rope_parameters))
    dense = FFNShape("dense", cfg.intermediate_size)
    moe = FFNShape("moe", cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok)
    blocks = tuple(BlockShape(attn, moe if cfg.is_moe(i) else dense) for i in range(cfg.num_layers))
    return ModelShapes(cfg.hidden_size, cfg.vocab_size, blocks)
