"""DeepseekV3Config: transformers' ``deepseek_v3`` decoder shape (DeepSeek-V3/R1, Kimi-K2,
Moonlight), read from a published config.json.

``DeepseekV3Config.from_hf`` accepts the config as the hub publishes it (``rope_theta`` and
``rope_scaling`` at the top level, DeepSeek's remote-code keys ``scoring_func``, ``topk_method``,
``moe_layer_freq``, ``quantization_config``...; Kimi-K2's ``model_type`` "kimi_k2") and as
transformers 5 writes it (``rope_parameters``, ``head_dim``, ``qk_head_dim``). Fields it does not
know raise an error instead of being dropped; values of the remote-code keys this model does not
implement (a softmax score, another top-k method, sparse MoE frequencies) are refused by name.
``DeepseekV3Config.preset("deepseek-v3-tiny" | "deepseek-v3" | "kimi-k2" | "moonlight-16b-a3b")``.

Layers ``0 .. first_k_dense_replace - 1`` are dense SwiGLU (``intermediate_size``), the rest MoE:
``n_routed_experts`` sigmoid-scored experts chosen by group-limited top-k (``n_group``,
``topk_group``) with a correction bias, weights renormalised with ``norm_topk_prob``, times
``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts (one SwiGLU of their summed
size). ``num_nextn_predict_layers`` multi-token-prediction depths (DeepSeek-V3's one, published
as layer ``num_hidden_layers``) are built after the last layer with core's MTP block
(``models/deepseek_v3/model.py``; transformers keeps the count but builds none). Export writes
``model_type`` "deepseek_v3" (Kimi-K2's "kimi_k2" needs remote code in transformers; the
architecture is the same).
"""
from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field

from core.moe.router import check_groups
from core.transformer.attention_backends import ATTENTION_BACKENDS
from core.transformer.rotary import ROPE_TYPES
from models.common.mtp_layers import mtp_layers_held
from models.registry import read_hf_config

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "attention_dropout", "output_router_logits", "_name_or_path",
    "auto_map", "ep_size", "pretraining_tp", "aux_loss_alpha", "seq_aux", "quantization_config", "head_dim",
    "qk_head_dim", "num_key_value_heads", "layer_types",
}
_REQUIRED_VALUES = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "hidden_act": "silu"}
_CONSUMED_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_shared_experts", "n_routed_experts", "num_local_experts", "routed_scaling_factor",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
    "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave", "attention_bias", "tie_word_embeddings",
    "initializer_range", "num_nextn_predict_layers", "num_mtp_layers", *_REQUIRED_VALUES,
}


@dataclass
class DeepseekV3Config:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432          # dense layers
    moe_intermediate_size: int = 2048       # each routed expert (and each shared one)
    num_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536          # None: a plain q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    num_experts: int = 256                  # n_routed_experts
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0       # MTP depths after the last layer (core/transformer/mtp.py)
    attention_backend: str = "auto"
    init_std: float = 0.02

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers {self.num_nextn_predict_layers} must be >= 0")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"first_k_dense_replace {self.first_k_dense_replace} must be in [0, {self.num_layers}]")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        check_groups(self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (rotary pairs)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend {self.attention_backend!r}: expected one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        kind = self.rope_parameters.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")

    # ------------------------------------------------------------------ derived
    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_mtp_layers(self) -> int:
        """Multi-token-prediction depths built after the last layer (core's name for the count)."""
        return self.num_nextn_predict_layers

    @property
    def head_dim(self) -> int:
        """The rotary head dim (transformers' ``head_dim`` for this family): RoPE's cos/sin width."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def aux_loss_coeff(self) -> float:
        """No auxiliary loss by default: the bias update balances the experts (aux-loss-free)."""
        return 0.0

    # ------------------------------------------------------------------ presets and HF
    @classmethod
    def preset(cls, name: str) -> "DeepseekV3Config":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
        return cls.from_hf(copy.deepcopy(PRESETS[name]))

    @classmethod
    def from_hf(cls, path_or_dict, **overrides) -> "DeepseekV3Config":
        """Read a Hugging Face ``config.json`` (a directory, a file or a dict)."""
        c = copy.deepcopy(read_hf_config(path_or_dict))
        where = path_or_dict if isinstance(path_or_dict, str) else "config.json"
        unknown = sorted(set(c) - _IGNORED_KEYS - _CONSUMED_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; this reader knows the deepseek_v3 "
                             "fields (see models/deepseek_v3/config.py)")
        for key, want in _REQUIRED_VALUES.items():
            if c.get(key, want) != want:
                raise ValueError(f"{where}: {key} {c[key]!r} is not supported (this model implements {want!r})")
        fields = _fields_from_hf(c)
        if isinstance(path_or_dict, str) and os.path.isdir(path_or_dict):  # models/common/mtp_layers.py
            fields["num_nextn_predict_layers"] = mtp_layers_held(path_or_dict, fields["num_layers"],
                                                                 fields["num_nextn_predict_layers"])
        return cls(**{**fields, **overrides})

    def to_hf(self) -> dict:
        """A ``config.json`` dict in the form transformers' DeepseekV3Config reads."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts, "n_group": self.n_group, "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor, "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace, "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": copy.deepcopy(self.rope_parameters), "rope_interleave": self.rope_interleave,
            "attention_bias": self.attention_bias, "tie_word_embeddings": self.tie_word_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers, "initializer_range": self.init_std,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_from_hf(c: dict) -> dict:
    """transformers' standardised rope parameters: one dict with ``rope_type`` and ``rope_theta``;
    yarn's ``factor`` defaults to max / original positions (transformers' rule)."""
    rp = dict(c.get("rope_parameters") or {})
    rp.update(c.get("rope_scaling") or {})
    rp["rope_type"] = rp.pop("type", None) or rp.get("rope_type") or "default"
    rp.setdefault("rope_theta", float(c.get("rope_theta", 10000.0)))
    if rp["rope_type"] in ("llama3", "yarn"):
        rp.setdefault("original_max_position_embeddings", c.get("max_position_embeddings", 4096))
    if rp["rope_type"] == "yarn" and rp.get("factor") is None:
        rp["factor"] = c.get("max_position_embeddings", 4096) / rp["original_max_position_embeddings"]
    return rp


def _fields_from_hf(c: dict) -> dict:
    experts = c.get("n_routed_experts", c.get("num_local_experts", 256))
    return dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        moe_intermediate_size=c.get("moe_intermediate_size", 2048), num_layers=c["num_hidden_layers"],
        num_attention_heads=c["num_attention_heads"], q_lora_rank=c.get("q_lora_rank", 1536),
        kv_lora_rank=c.get("kv_lora_rank", 512), qk_nope_head_dim=c.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=c.get("qk_rope_head_dim", 64), v_head_dim=c.get("v_head_dim", 128),
        num_experts=experts, num_experts_per_tok=c.get("num_experts_per_tok", 8),
        n_shared_experts=c.get("n_shared_experts", 1), n_group=c.get("n_group") or 1,
        topk_group=c.get("topk_group") or 1, routed_scaling_factor=float(c.get("routed_scaling_factor", 2.5)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        first_k_dense_replace=int(c.get("first_k_dense_replace", 3)),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_parameters=_rope_from_hf(c),
        rope_interleave=bool(c.get("rope_interleave", True)), attention_bias=bool(c.get("attention_bias", False)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0),
        init_std=float(c.get("initializer_range", 0.02)),
    )


def _tiny_config() -> dict:
    """CPU-sized: one dense layer, then MoE with 8 experts in 4 groups (2 kept), top-2, one
    shared expert, q low-rank, interleaved rope; vocabulary 320 as the other tiny presets, so the
    byte-tokenized sample data trains it. Sizes are multiples of 8 so grouped_mm runs on CPU."""
    return {"model_type": "deepseek_v3", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "first_k_dense_replace": 1, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_interleave": True, "tie_word_embeddings": False}


def _hub(**kw) -> dict:
    """A published config.json's fields that matter (DeepSeek's remote-code form)."""
    base = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "kv_lora_rank": 512, "moe_layer_freq": 1, "norm_topk_prob": True,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "tie_word_embeddings": False,
            "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True}
    return {**base, **kw}


_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
_YARN = {"type": "yarn", "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
PRESETS = {
    "deepseek-v3-tiny": _tiny_config(),
    "deepseek-v3": _hub(  # deepseek-ai/DeepSeek-V3 (and R1): 671B, plus its MTP layer
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, first_k_dense_replace=3, max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000, rope_scaling={**_YARN, "factor": 40, "beta_fast": 32, "beta_slow": 1},
        num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=1, quantization_config=_FP8),
    "kimi-k2": _hub(  # moonshotai/Kimi-K2-Instruct: 1.03T
        model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
        q_lora_rank=1536, n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=50000.0, rope_scaling={**_YARN, "factor": 32.0, "beta_fast": 1.0,
                                                              "beta_slow": 1.0},
        num_nextn_predict_layers=0, bos_token_id=163584, eos_token_id=163585, quantization_config=_FP8),
    "moonlight-16b-a3b": _hub(  # moonshotai/Moonlight-16B-A3B: no q low-rank, bf16 weights
        vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
        n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, n_group=1, topk_group=1,
        routed_scaling_factor=2.446, first_k_dense_replace=1, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=50000.0, num_nextn_predict_layers=0, bos_token_id=163584, eos_token_id=163585,
        aux_loss_alpha=0.001, seq_aux=True),
}
