"""A third model family that lives only in the test tree: a dense-FFN decoder from core's blocks
(plain RMSNorm, GQA with q/k norms, SwiGLU), registered by importing this module, so
``pretrain_step37.py --model-module tests.fake_family --model-preset fake-dense-tiny`` trains it
with no change outside tests/."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from core.shapes import AttentionShape, BlockShape, FFNShape, ModelShapes
from core.transformer.attention import Attention
from core.transformer.block import DecoderBlock
from core.transformer.mlp import SwiGLUMLP
from core.transformer.norm import RMSNorm
from models.common.decoder import DecoderLM
from models.registry import ModelSpec, read_hf_config, register


@dataclass
class FakeDenseConfig:
    vocab_size: int = 320
    hidden_size: int = 32
    intermediate_size: int = 64
    num_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    max_position_embeddings: int = 4096
    attention_backend: str = "auto"
    init_std: float = 0.02
    num_experts, num_experts_per_tok, num_mtp_layers, aux_loss_coeff = 0, 0, 0, 0.0  # dense: no MoE, no MTP

    @classmethod
    def from_hf(cls, src, **overrides):
        return cls(**{**{k: v for k, v in read_hf_config(src).items() if k != "model_type"}, **overrides})

    @classmethod
    def preset(cls, name):
        return cls()

    def to_hf(self):
        return {"model_type": "fake_dense", **asdict(self)}

    def to_dict(self):
        return asdict(self)


class FakeDenseModel(DecoderLM):
    def make_layer(self, i, experts):
        c = self.config
        attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, window=None,
                         softmax_scale=c.head_dim ** -0.5, eps=1e-6, backend=c.attention_backend, norm_offset=False)
        return DecoderBlock(self.make_norm(), attn, self.make_norm(), SwiGLUMLP(c.hidden_size, c.intermediate_size))

    def make_norm(self):
        return RMSNorm(self.config.hidden_size, 1e-6, offset=False)

    def rope_parameters(self, key):
        return {"rope_type": "default", "rope_theta": 10000.0}


def shapes(c: FakeDenseConfig) -> ModelShapes:
    block = BlockShape(AttentionShape(c.num_attention_heads, c.num_key_value_heads, c.head_dim, rotary_dim=c.head_dim),
                       FFNShape("dense", c.intermediate_size))
    return ModelShapes(c.hidden_size, c.vocab_size, (block,) * c.num_layers)


SPEC = register(ModelSpec("fake_dense", FakeDenseConfig, FakeDenseModel, shapes, model_types=("fake_dense",),
                          presets=("fake-dense-tiny",), description="test-only dense decoder"))
