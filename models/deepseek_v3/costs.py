"""DeepSeek-V3's blocks as shapes (``core/costs/shapes.py``), for the FLOP, activation and planner
models: multi-head latent attention (:class:`~core.costs.shapes.MLAShape`: its low-rank projections,
scores at the q/k dim and values at the value dim, the latent the CP exchange is planned to move),
dense SwiGLU on the first ``first_k_dense_replace`` layers, then routed experts with the shared
experts as one always-on expert of their summed size; each MTP depth (``num_nextn_predict_layers``)
is decoder layer ``num_layers + k`` with an ``eh_proj`` input projection (2 x hidden) and its own
head (the embedding is shared: a lookup). Group-limited routing (``n_group``,
``topk_group``) changes which experts a token picks, not how many: nothing to cost. Parameter
memory is not from here (the planner counts the model built on ``meta``)."""
from __future__ import annotations

from core.costs.shapes import BlockShape, FFNShape, MLAShape, ModelShapes
from models.deepseek_v3.config import DeepseekV3Config


def attention_shape(cfg: DeepseekV3Config) -> MLAShape:
    return MLAShape(cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                    cfg.v_head_dim, cfg.q_lora_rank)


def model_shapes(cfg: DeepseekV3Config) -> ModelShapes:
    attn = attention_shape(cfg)
    dense = FFNShape("dense", cfg.intermediate_size)
    moe = FFNShape("moe", cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                   shared=cfg.shared_intermediate_size)
    ffn = lambda i: moe if cfg.is_moe(i) else dense  # noqa: E731
    blocks = tuple(BlockShape(attn, ffn(i)) for i in range(cfg.num_layers))
    extra = tuple(BlockShape(attn, ffn(cfg.num_layers + k), input_proj=2 * cfg.hidden_size, head=True)
                  for k in range(cfg.num_mtp_layers))
    return ModelShapes(cfg.hidden_size, cfg.vocab_size, blocks, extra)
