"""Glm4MoeConfig: transformers' ``glm4_moe`` decoder shape (GLM-4.5, GLM-4.5-Air), read from a
published config.json.

``Glm4MoeConfig.from_hf`` accepts the config as the hub publishes it (``rope_theta``,
``partial_rotary_factor`` and ``rope_scaling`` at the top level) and as transformers 5 writes it
(``rope_parameters`` holding them). ``partial_rotary_factor`` defaults to 0.5 when a config has
none, as transformers' ``Glm4MoeConfig`` does. Fields it does not know raise an error instead of
being dropped. ``Glm4MoeConfig.preset("glm4-moe-tiny" | "glm-4.5" | "glm-4.5-air")``.

Layers ``0 .. first_k_dense_replace - 1`` are dense SwiGLU (``intermediate_size``), the rest MoE:
``n_routed_experts`` sigmoid-scored experts chosen by ``score + e_score_correction_bias`` among
the ``topk_group`` best of ``n_group`` groups, weighted by the unbiased scores (renormalised with
``norm_topk_prob``), times ``routed_scaling_factor``, plus ``n_shared_experts`` always-on experts
(one SwiGLU of their summed size). ``num_nextn_predict_layers`` multi-token-prediction layers
(GLM-4.5: 1, published as ``model.layers.{num_hidden_layers}``) are built with core's MTP block;
transformers' ``Glm4MoeForCausalLM`` builds none (it ignores those tensors), so a checkpoint
written by its ``save_pretrained`` says 1 but holds no MTP tensors: read from a checkpoint folder,
the count is that of the MTP layers its weights hold (``mtp_layers_held``), so such a folder
loads without one and exports ``num_nextn_predict_layers`` 0; a config without weights beside it
(a preset, a ``--hf-config`` file) is taken as it says.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import asdict, dataclass, field

from core.moe.router import check_groups
from core.transformer.attention_backends import ATTENTION_BACKENDS
from core.transformer.rotary import ROPE_TYPES
from models.common.mtp_layers import mtp_layers_held
from models.registry import read_hf_config

MODEL_TYPES = ("glm4_moe",)
DEFAULT_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig when a config gives none
_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "attention_dropout", "output_router_logits", "_name_or_path",
    "quantization_config", "layer_types",
}
_CONSUMED_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "n_shared_experts", "n_routed_experts",
    "num_local_experts", "routed_scaling_factor", "n_group", "topk_group", "num_experts_per_tok",
    "first_k_dense_replace", "norm_topk_prob", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias", "use_qk_norm",
    "tie_word_embeddings", "initializer_range", "num_nextn_predict_layers", "num_mtp_layers",
}


@dataclass
class Glm4MoeConfig:
    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944          # dense layers
    moe_intermediate_size: int = 1408       # each routed expert (and each shared one)
    num_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128
    num_experts: int = 128                  # n_routed_experts
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6,
                                                           "partial_rotary_factor": DEFAULT_PARTIAL_ROTARY})
    attention_bias: bool = True             # q/k/v biases (o_proj never has one)
    use_qk_norm: bool = False               # per-head RMSNorm on q and k before RoPE
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1       # MTP layers after the last layer (core's MTP block)
    attention_backend: str = "auto"
    init_std: float = 0.02

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} attention heads do not divide into "
                             f"{self.num_key_value_heads} key/value heads")
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(f"first_k_dense_replace {self.first_k_dense_replace} must be in [0, {self.num_layers}]")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        check_groups(self.num_experts, self.num_experts_per_tok, self.n_group, self.topk_group)
        if self.num_nextn_predict_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend {self.attention_backend!r}: expected one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        kind = self.rope_parameters.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")
        rot = int(self.head_dim * self.rope_parameters.get("partial_rotary_factor", 1.0))
        if rot < 2 or rot % 2:
            raise ValueError(f"partial_rotary_factor {self.rope_parameters.get('partial_rotary_factor')} of "
                             f"head_dim {self.head_dim} rotates {rot} dims: it must be an even number >= 2")

    # ------------------------------------------------------------------ derived
    def is_moe(self, layer: int) -> bool:
        """Layer ``layer`` (an MTP layer counts on from ``num_layers``) has routed experts."""
        return layer >= self.first_k_dense_replace

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def aux_loss_coeff(self) -> float:
        """No auxiliary loss by default: the bias update balances the experts (aux-loss-free)."""
        return 0.0

    # ------------------------------------------------------------------ presets and HF
    @classmethod
    def preset(cls, name: str) -> "Glm4MoeConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
        return cls.from_hf(copy.deepcopy(PRESETS[name]))

    @classmethod
    def from_hf(cls, path_or_dict, **overrides) -> "Glm4MoeConfig":
        """Read a Hugging Face ``config.json`` (a directory, a file or a dict)."""
        c = copy.deepcopy(read_hf_config(path_or_dict))
        where = path_or_dict if isinstance(path_or_dict, str) else "config.json"
        unknown = sorted(set(c) - _IGNORED_KEYS - _CONSUMED_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; this reader knows the glm4_moe fields "
                             "(see models/glm4_moe/config.py)")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {c['hidden_act']!r} is not supported (silu)")
        fields = _fields_from_hf(c)
        if isinstance(path_or_dict, str) and os.path.isdir(path_or_dict):
            fields["num_nextn_predict_layers"] = mtp_layers_held(path_or_dict, fields["num_layers"],
                                                                 fields["num_nextn_predict_layers"])
        return cls(**{**fields, **overrides})

    def to_hf(self) -> dict:
        """A ``config.json`` dict in the form transformers' Glm4MoeConfig reads."""
        return {
            "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "n_routed_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts, "n_group": self.n_group, "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor, "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": copy.deepcopy(self.rope_parameters), "attention_bias": self.attention_bias,
            "use_qk_norm": self.use_qk_norm, "tie_word_embeddings": self.tie_word_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers, "initializer_range": self.init_std,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_from_hf(c: dict) -> dict:
    """transformers' standardised rope parameters: one dict with ``rope_type``, ``rope_theta`` and
    ``partial_rotary_factor`` (0.5 when the config has none, transformers' default for glm4_moe);
    yarn's ``factor`` defaults to max / original positions (transformers' rule)."""
    rp = dict(c.get("rope_parameters") or {})
    rp.update(c.get("rope_scaling") or {})
    rp["rope_type"] = rp.pop("type", None) or rp.get("rope_type") or "default"
    rp.setdefault("rope_theta", float(c.get("rope_theta", 10000.0)))
    rp.setdefault("partial_rotary_factor", float(c.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)))
    if rp["rope_type"] in ("llama3", "yarn"):
        rp.setdefault("original_max_position_embeddings", c.get("max_position_embeddings", 131072))
    if rp["rope_type"] == "yarn" and rp.get("factor") is None:
        rp["factor"] = c.get("max_position_embeddings", 131072) / rp["original_max_position_embeddings"]
    return rp


def _fields_from_hf(c: dict) -> dict:
    heads = c["num_attention_heads"]
    return dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        moe_intermediate_size=c.get("moe_intermediate_size", 1408), num_layers=c["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        num_experts=c.get("n_routed_experts", c.get("num_local_experts", 128)),
        num_experts_per_tok=c.get("num_experts_per_tok", 8), n_shared_experts=c.get("n_shared_experts", 1),
        n_group=c.get("n_group") or 1, topk_group=c.get("topk_group") or 1,
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        first_k_dense_replace=int(c.get("first_k_dense_replace", 1)),
        max_position_embeddings=c.get("max_position_embeddings", 131072),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)), rope_parameters=_rope_from_hf(c),
        attention_bias=bool(c.get("attention_bias", False)), use_qk_norm=bool(c.get("use_qk_norm", False)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_nextn_predict_layers=int(c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 1)) or 0),
        init_std=float(c.get("initializer_range", 0.02)),
    )


def _tiny_config() -> dict:
    """CPU-sized: one dense layer, then MoE with 8 experts in 4 groups (2 kept), top-2, one shared
    expert, q/k/v biases, q/k norms, half-rotary heads, one MTP layer; vocabulary 320 as the other
    tiny presets, so the byte-tokenized sample data trains it. Sizes are multiples of 8 so
    grouped_mm runs on CPU."""
    return {"model_type": "glm4_moe", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "first_k_dense_replace": 1, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 1e6, "partial_rotary_factor": 0.5, "attention_bias": True,
            "use_qk_norm": True, "num_nextn_predict_layers": 1, "tie_word_embeddings": False}


def _hub(**kw) -> dict:
    """A published config.json's fields (zai-org/GLM-4.5 and GLM-4.5-Air share all but these)."""
    base = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
            "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
            "head_dim": 128, "hidden_act": "silu", "partial_rotary_factor": 0.5, "initializer_range": 0.02,
            "max_position_embeddings": 131072, "norm_topk_prob": True, "num_attention_heads": 96,
            "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
            "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "use_cache": True, "vocab_size": 151552}
    return {**base, **kw}


PRESETS = {
    "glm4-moe-tiny": _tiny_config(),
    "glm-4.5": _hub(  # zai-org/GLM-4.5 ("355B"): 352.8B without its MTP layer, 357.6B with it
        hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=92,
        n_routed_experts=160, routed_scaling_factor=2.5, first_k_dense_replace=3, use_qk_norm=True),
    "glm-4.5-air": _hub(  # zai-org/GLM-4.5-Air ("106B"): 106.9B without its MTP layer, 109.8B with it
        hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46,
        n_routed_experts=128, routed_scaling_factor=1.0, first_k_dense_replace=1, use_qk_norm=False),
}
