"""DeepSeek-V3's blocks as shapes (``core/shapes.py``), for the FLOP, activation and planner
models: dense SwiGLU on the first ``first_k_dense_replace`` layers, then routed experts with the
shared experts as one always-on expert of their summed size.

Attention is a stand-in until ``core/shapes.py`` has a shape of its own for multi-head latent
attention: a GQA shape with as many K/V heads as query heads, each of the q/k head dim
(``qk_nope_head_dim + qk_rope_head_dim``). That gets the expanded per-head K/V that the kernels
see right (V padded to the q/k dim where a kernel needs it) and the score FLOPs, but not the
projections: it counts four ``hidden x heads x head_dim`` matrices where MLA has its low-rank
ones (about 3.8x MLA's projection FLOPs on DeepSeek-V3), so predicted step times and MFU of this
family lean pessimistic. Parameter memory is not from here (the planner counts the model built
on ``meta``)."""
from __future__ import annotations

from core.shapes import AttentionShape, BlockShape, FFNShape, ModelShapes
from models.deepseek_v3.config import DeepseekV3Config


def model_shapes(cfg: DeepseekV3Config) -> ModelShapes:
    attn = AttentionShape(cfg.num_attention_heads, cfg.num_attention_heads, cfg.qk_head_dim, None,
                          gate=False, rotary_dim=cfg.qk_rope_head_dim)
    dense = FFNShape("dense", cfg.intermediate_size)
    moe = FFNShape("moe", cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                   shared=cfg.shared_intermediate_size)
    blocks = tuple(BlockShape(attn, moe if cfg.is_moe(i) else dense) for i in range(cfg.num_layers))
    return ModelShapes(cfg.hidden_size, cfg.vocab_size, blocks)
