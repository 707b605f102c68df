"""A third model family that lives only in the test tree: a dense-FFN decoder from core's blocks
(plain RMSNorm, SwiGLU, and GQA with q/k norms or, with ``attention="mla"``, core's multi-head
latent attention), registered by importing this module, so
``pretrain_step37.py --model-module tests.fake_family --model-preset fake-dense-tiny`` (or
``fake-mla-tiny``) trains it with no change outside tests/."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from core.costs.shapes import AttentionShape, BlockShape, FFNShape, MLAShape, ModelShapes
from core.transformer.attention import Attention
from core.transformer.block import DecoderBlock
from core.transformer.mla import MLAttention
from core.transformer.mlp import SwiGLUMLP
from core.transformer.norm import RMSNorm
from models.common.decoder import DecoderLM
from models.registry import ModelSpec, read_hf_config, register

ATTENTION = ("gqa", "mla")
PRESETS = {"fake-dense-tiny": {},
           # q low-rank MLA: rope dims (head_dim) 8 + nope 8 per q/k head, a value head dim of 8 below it
           "fake-mla-tiny": dict(attention="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8)}


@dataclass
class FakeDenseConfig:
    vocab_size: int = 320
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8                   # GQA: each head's; MLA: the rotary dims (qk_rope_head_dim)
    max_position_embeddings: int = 4096
    attention_backend: str = "auto"
    init_std: float = 0.02
    attention: str = "gqa"              # "mla": core's MLAttention with the fields below
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts, num_experts_per_tok, num_mtp_layers, aux_loss_coeff = 0, 0, 0, 0.0  # dense: no MoE, no MTP

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r}: expected one of {', '.join(ATTENTION)}")

    @classmethod
    def from_hf(cls, src, **overrides):
        return cls(**{**{k: v for k, v in read_hf_config(src).items() if k != "model_type"}, **overrides})

    @classmethod
    def preset(cls, name):
        return cls(**PRESETS[name])

    def to_hf(self):
        return {"model_type": "fake_dense", **asdict(self)}

    def to_dict(self):
        return asdict(self)


class FakeDenseModel(DecoderLM):
    def make_layer(self, i, experts):
        c = self.config
        if c.attention == "mla":
            attn = MLAttention(c.hidden_size, c.num_attention_heads, q_lora_rank=c.q_lora_rank,
                               kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                               qk_rope_head_dim=c.head_dim, v_head_dim=c.v_head_dim,
                               softmax_scale=(c.qk_nope_head_dim + c.head_dim) ** -0.5, backend=c.attention_backend)
        else:
            attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, window=None,
                             softmax_scale=c.head_dim ** -0.5, eps=1e-6, backend=c.attention_backend,
                             norm_offset=False)
        return DecoderBlock(self.make_norm(), attn, self.make_norm(), SwiGLUMLP(c.hidden_size, c.intermediate_size))

    def make_norm(self):
        return RMSNorm(self.config.hidden_size, 1e-6, offset=False)

    def rope_parameters(self, key):
        return {"rope_type": "default", "rope_theta": 10000.0}


def shapes(c: FakeDenseConfig) -> ModelShapes:
    if c.attention == "mla":  # core's own MLA cost shape, as models/deepseek_v3/costs.py
        attn = MLAShape(c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.head_dim, c.v_head_dim,
                        c.q_lora_rank)
    else:
        attn = AttentionShape(c.num_attention_heads, c.num_key_value_heads, c.head_dim, rotary_dim=c.head_dim)
    block = BlockShape(attn, FFNShape("dense", c.intermediate_size))
    return ModelShapes(c.hidden_size, c.vocab_size, (block,) * c.num_layers)


SPEC = register(ModelSpec("fake_dense", FakeDenseConfig, FakeDenseModel, shapes, model_types=("fake_dense",),
                          presets=tuple(PRESETS), description="test-only dense decoder (GQA or MLA attention)"))
