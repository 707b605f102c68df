"""Qwen3MoeConfig: transformers' ``qwen3_moe`` decoder shape, read from a published config.json.

``Qwen3MoeConfig.from_hf`` accepts the config as the hub publishes it (``rope_theta`` and
``rope_scaling`` at the top level, ``num_experts``) and as transformers 5 writes it
(``rope_parameters``, ``num_local_experts``). Fields it does not know raise an error instead of
being dropped. ``Qwen3MoeConfig.preset("qwen3-moe-tiny" | "qwen3-30b-a3b" | "qwen3-235b-a22b")``.

Which layers are MoE follows transformers: layer ``i`` is MoE unless it is in ``mlp_only_layers``,
and only when ``(i + 1) % decoder_sparse_step == 0``; with ``use_sliding_window`` every layer
attends to a window of ``sliding_window`` keys (counting the query), as transformers' qwen3_moe.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from core.transformer.attention_backends import ATTENTION_BACKENDS
from core.transformer.rotary import ROPE_TYPES
from models.registry import read_hf_config

_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "attention_dropout", "output_router_logits",
    "max_window_layers", "tie_word_embeddings", "_name_or_path", "initializer_range", "layer_types",
}
_CONSUMED_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "use_sliding_window",
    "sliding_window", "decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok",
    "num_experts", "num_local_experts", "norm_topk_prob", "router_aux_loss_coef", "mlp_only_layers",
}


@dataclass
class Qwen3MoeConfig:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144           # dense layers (mlp_only_layers)
    num_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None       # keys seen, counting the query (with use_sliding_window)
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    tie_word_embeddings: bool = False
    attention_backend: str = "auto"
    init_std: float = 0.02

    num_mtp_layers = 0  # no extra blocks after the last layer

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} attention heads do not divide into "
                             f"{self.num_key_value_heads} key/value heads")
        if not 1 <= self.num_experts_per_tok <= max(1, self.num_experts):
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, {self.num_experts}]")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad}: not layers of a {self.num_layers}-layer model")
        if self.use_sliding_window and not (self.sliding_window and self.sliding_window >= 1):
            raise ValueError("use_sliding_window needs sliding_window >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend {self.attention_backend!r}: expected one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        kind = self.rope_parameters.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")

    # ------------------------------------------------------------------ derived
    def is_moe(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def window(self) -> int | None:
        return self.sliding_window if self.use_sliding_window else None

    @property
    def aux_loss_coeff(self) -> float:
        """The default router auxiliary-loss weight: the config's ``router_aux_loss_coef``."""
        return self.router_aux_loss_coef

    # ------------------------------------------------------------------ presets and HF
    @classmethod
    def preset(cls, name: str) -> "Qwen3MoeConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
        return cls.from_hf(copy.deepcopy(PRESETS[name]))

    @classmethod
    def from_hf(cls, path_or_dict, **overrides) -> "Qwen3MoeConfig":
        """Read a Hugging Face ``config.json`` (a directory, a file or a dict)."""
        c = copy.deepcopy(read_hf_config(path_or_dict))
        unknown = sorted(set(c) - _IGNORED_KEYS - _CONSUMED_KEYS)
        if unknown:
            raise ValueError(f"config.json: unknown field(s) {unknown}; this reader knows the "
                             "qwen3_moe fields (see models/qwen3_moe/config.py)")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {c['hidden_act']!r} is not supported (silu)")
        return cls(**{**_fields_from_hf(c), **overrides})

    def to_hf(self) -> dict:
        """A ``config.json`` dict in the form transformers' Qwen3MoeConfig reads."""
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_parameters": copy.deepcopy(self.rope_parameters),
            "attention_bias": self.attention_bias, "use_sliding_window": self.use_sliding_window,
            "sliding_window": self.sliding_window, "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers), "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob, "router_aux_loss_coef": self.router_aux_loss_coef,
            "tie_word_embeddings": self.tie_word_embeddings, "initializer_range": self.init_std,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_from_hf(c: dict) -> dict:
    """transformers' standardised rope parameters: one dict with ``rope_type`` and ``rope_theta``;
    the scaling types get ``original_max_position_embeddings`` (default: the model's maximum)."""
    rp = dict(c.get("rope_parameters") or {})
    scaling = c.get("rope_scaling") or {}
    rp.update(scaling)
    rp["rope_type"] = rp.pop("type", None) or rp.get("rope_type") or "default"
    rp.setdefault("rope_theta", float(c.get("rope_theta", 10000.0)))
    if rp["rope_type"] in ("llama3", "yarn"):
        rp.setdefault("original_max_position_embeddings", c.get("max_position_embeddings", 40960))
    if rp["rope_type"] == "yarn" and rp.get("factor") is None:
        rp["factor"] = c.get("max_position_embeddings", 40960) / rp["original_max_position_embeddings"]
    return rp


def _fields_from_hf(c: dict) -> dict:
    heads = c["num_attention_heads"]
    return dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        max_position_embeddings=c.get("max_position_embeddings", 40960),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), rope_parameters=_rope_from_hf(c),
        attention_bias=bool(c.get("attention_bias", False)),
        use_sliding_window=bool(c.get("use_sliding_window", False)),
        sliding_window=c.get("sliding_window") if c.get("use_sliding_window") else None,
        decoder_sparse_step=int(c.get("decoder_sparse_step", 1)),
        mlp_only_layers=list(c.get("mlp_only_layers") or []),
        moe_intermediate_size=c.get("moe_intermediate_size", 768),
        num_experts=c.get("num_experts", c.get("num_local_experts", 128)),
        num_experts_per_tok=c.get("num_experts_per_tok", 8),
        norm_topk_prob=bool(c.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_std=float(c.get("initializer_range", 0.02)),
    )


def _tiny_config() -> dict:
    """CPU-sized: a dense first layer (mlp_only_layers), MoE with renormalised top-2 of 8 experts,
    q/k norms; vocabulary 320 as Step-3.7's tiny, so the byte-tokenized sample data trains it.
    Sizes are multiples of 8 so grouped_mm runs on CPU."""
    return {"model_type": "qwen3_moe", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "mlp_only_layers": [0], "decoder_sparse_step": 1, "moe_intermediate_size": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001, "tie_word_embeddings": False}


def _hub(hidden, inter, moe_inter, layers, heads) -> dict:
    """The published config.json of Qwen3-30B-A3B / Qwen3-235B-A22B (the fields that matter)."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 40960, "max_window_layers": layers, "rms_norm_eps": 1e-6,
            "rope_scaling": None, "rope_theta": 1000000.0, "attention_bias": False, "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "moe_intermediate_size": moe_inter, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
            "output_router_logits": False, "tie_word_embeddings": False, "bos_token_id": 151643,
            "eos_token_id": 151645, "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True}


PRESETS = {"qwen3-moe-tiny": _tiny_config(), "qwen3-30b-a3b": _hub(2048, 6144, 768, 48, 32),
           "qwen3-235b-a22b": _hub(4096, 12288, 1536, 94, 64)}
