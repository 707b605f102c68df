"""GLM-4.5's blocks as shapes (``core/costs/shapes.py``), for the FLOP, activation and planner models:
ungated GQA with partial rotary (``head_dim * partial_rotary_factor`` dims) on every layer,
dense SwiGLU on the first ``first_k_dense_replace`` layers, then routed experts with the shared
experts as one always-on expert of their summed size; each MTP depth is an MoE decoder layer with
an ``eh_proj`` input projection (2 x hidden) and its own head. The q/k/v biases and q/k norms are
not costed (a few vectors per layer: below the model's resolution)."""
from __future__ import annotations

from core.costs.shapes import AttentionShape, BlockShape, FFNShape, ModelShapes
from core.transformer.rotary import rotary_dim
from models.glm4_moe.config import Glm4MoeConfig


def model_shapes(cfg: Glm4MoeConfig) -> ModelShapes:
    attn = AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, None, gate=False,
                          rotary_dim=rotary_dim(cfg.head_dim, cfg.rope_parameters))
    dense = FFNShape("dense", cfg.intermediate_size)
    moe = FFNShape("moe", cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                   shared=cfg.shared_intermediate_size)
    ffn = lambda i: moe if cfg.is_moe(i) else dense  # noqa: E731
    blocks = tuple(BlockShape(attn, ffn(i)) for i in range(cfg.num_layers))
    extra = tuple(BlockShape(attn, ffn(cfg.num_layers + k), input_proj=2 * cfg.hidden_size, head=True)
                  for k in range(cfg.num_mtp_layers))
    return ModelShapes(cfg.hidden_size, cfg.vocab_size, blocks, extra)
