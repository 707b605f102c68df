"""Step37Config: the Step-3.5 / Step-3.7 text decoder's shape, read from a published config.json.

``Step37Config.from_hf`` accepts the config as the hub publishes it (Step-3.5 top level, or
Step-3.7's ``text_config``; legacy keys ``moe_layers_enum``, ``attention_other_setting``,
per-layer ``rope_theta`` / ``partial_rotary_factors`` lists padded with MTP entries,
``rope_scaling``) and as transformers' ``save_pretrained`` writes it (``rope_parameters``,
``mlp_layer_types``, ``per_layer_config``, ``num_sliding_attention_heads``). Fields it does not
know raise an error instead of being dropped. ``Step37Config.preset("step37-flash" | "tiny" |
"step37-flash-vlm" | "step37-tiny-vlm")``.

A Step-3.7 config with a ``vision_config`` (top level, beside ``text_config``) also gives the
vision tower (``vision``: ``models/step37/vision_config.py``), the placeholder token
(``image_token_id``) and whether the projector has a bias (``projector_bias``); ``to_hf`` then
writes transformers' ``Step3p7Config`` form. ``from_hf(path, vision=None)`` reads such a
checkpoint as the text decoder alone (the tower's weights then pass through an export untouched).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field

from core.transformer.attention_backends import ATTENTION_BACKENDS
from models.step37.vision_config import Step37VisionConfig

ATTENTION_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")

# Keys of published / saved configs that carry no information for the text decoder's maths.
_IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "attention_dropout", "hidden_act", "output_router_logits", "attention_bias", "mlp_bias",
    "max_seq_len", "use_moe", "moe_every_n_layer", "moe_layer_offset", "moe_dynamic_exp_p",
    "norm_expert_weight", "att_impl_type", "use_rope_layers", "yarn_only_types",
    "mtp_layer_types", "mtp_mlp_layer_types", "per_layer_config", "mtp_per_layer_config",
    "image_token_id", "vision_config", "projector_bias", "text_config", "tokenizer_class",
    "use_bidirectional_attention", "gating", "sliding_window_pattern", "_name_or_path",
    "quantization_config", "moe_router_activation", "use_moe_router_bias",
    "use_head_wise_attn_gate", "zero_centered", "tie_word_embeddings", "num_mtp_layers",
}
_CONSUMED_KEYS = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "num_attention_groups", "head_dim", "layer_types", "mlp_layer_types",
    "moe_layers_enum", "num_sliding_attention_heads", "attention_other_setting", "sliding_window",
    "moe_intermediate_size", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
    "moe_top_k", "share_expert_dim", "share_expert_dims", "moe_router_scaling_factor",
    "swiglu_limits", "swiglu_limits_shared", "rope_theta", "partial_rotary_factors", "need_fp32_gate",
    "rope_scaling", "rope_parameters", "query_pre_attn_scalar", "rms_norm_eps",
    "max_position_embeddings", "num_nextn_predict_layers", "num_local_experts",
}


@dataclass
class Step37Config:
    """Shape of the text decoder. Per-layer lists have one entry per main layer; the MTP depths
    have their own ``mtp_*`` lists."""

    vocab_size: int = 128896
    hidden_size: int = 4096
    num_layers: int = 45
    num_attention_heads: int = 64            # full-attention layers
    num_sliding_attention_heads: int = 96    # sliding-attention layers
    num_key_value_heads: int = 8
    head_dim: int = 128
    layer_types: list = field(default_factory=list)
    sliding_window: int = 512                # keys seen, counting the query itself
    mlp_layer_types: list = field(default_factory=list)
    intermediate_size: int = 11264           # dense SwiGLU
    moe_intermediate_size: int = 1280
    num_experts: int = 288
    num_experts_per_tok: int = 8
    shared_expert_size: int = 1280
    moe_router_scaling_factor: float = 3.0
    swiglu_limits: list = field(default_factory=list)         # routed experts; None: no clamp
    swiglu_limits_shared: list = field(default_factory=list)  # shared expert and dense MLP
    rope_parameters: dict = field(default_factory=dict)       # per layer type, transformers' keys
    query_pre_attn_scalar: float = 128.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    num_mtp_layers: int = 0
    mtp_layer_types: list = field(default_factory=list)
    mtp_mlp_layer_types: list = field(default_factory=list)
    mtp_swiglu_limits: list = field(default_factory=list)
    mtp_swiglu_limits_shared: list = field(default_factory=list)
    attention_backend: str = "auto"
    init_std: float = 0.02
    need_fp32_gate: bool = True             # the router computes in fp32 under --bf16
    vision: Step37VisionConfig | None = None  # the vision tower (Step-3.7 VLM); None: text only
    image_token_id: int | None = None        # the placeholder token image features replace
    projector_bias: bool = False             # multi_modal_projector has a bias

    def __post_init__(self):
        if isinstance(self.vision, dict):  # from to_dict() (run checkpoints' metadata)
            self.vision = Step37VisionConfig(**self.vision)
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        L, D = self.num_layers, self.num_mtp_layers
        for name, n in (("layer_types", L), ("mlp_layer_types", L), ("swiglu_limits", L),
                        ("swiglu_limits_shared", L), ("mtp_layer_types", D),
                        ("mtp_mlp_layer_types", D), ("mtp_swiglu_limits", D),
                        ("mtp_swiglu_limits_shared", D)):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Step37Config.{name} has {len(getattr(self, name))} entries, "
                                 f"expected {n}")
        for t in self.layer_types + self.mtp_layer_types:
            if t not in ATTENTION_TYPES:
                raise ValueError(f"layer type {t!r} is not one of {ATTENTION_TYPES}")
            if t not in self.rope_parameters:
                raise ValueError(f"rope_parameters has no entry for layer type {t!r}")
        for t in self.mlp_layer_types + self.mtp_mlp_layer_types:
            if t not in MLP_TYPES:
                raise ValueError(f"mlp layer type {t!r} is not one of {MLP_TYPES}")
        for heads in (self.num_attention_heads, self.num_sliding_attention_heads):
            if heads % self.num_key_value_heads:
                raise ValueError(f"{heads} attention heads do not divide into "
                                 f"{self.num_key_value_heads} key/value heads")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"[1, {self.num_experts}]")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend {self.attention_backend!r}: expected one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        for t, p in self.rope_parameters.items():
            if p.get("rope_type", "default") not in ("default", "llama3"):
                raise ValueError(f"rope_type {p.get('rope_type')!r} for {t} is not supported "
                                 "(default, llama3)")
            if not 0 < p.get("partial_rotary_factor", 1.0) <= 1:
                raise ValueError(f"partial_rotary_factor for {t} must be in (0, 1]")
            if int(self.head_dim * p.get("partial_rotary_factor", 1.0)) % 2:
                raise ValueError(f"rotary dimension for {t} must be even")

    @property
    def aux_loss_coeff(self) -> float:
        """The default router auxiliary-loss weight: none (Step-3.x balances by the bias)."""
        return 0.0

    def num_heads(self, layer_type: str) -> int:
        return self.num_attention_heads if layer_type == "full_attention" else self.num_sliding_attention_heads

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str) -> "Step37Config":
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
        return cls.from_hf(copy.deepcopy(PRESETS[name]))

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf(cls, path_or_dict, **overrides) -> "Step37Config":
        """Read a Hugging Face ``config.json`` (a directory, a file or a dict)."""
        if isinstance(path_or_dict, dict):
            raw = copy.deepcopy(path_or_dict)
        else:
            path = os.path.join(path_or_dict, "config.json") if os.path.isdir(path_or_dict) else path_or_dict
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        cfg = raw.get("text_config") or raw
        unknown = sorted(set(cfg) - _IGNORED_KEYS - _CONSUMED_KEYS)
        if unknown:
            raise ValueError(f"config.json: unknown field(s) {unknown}; this reader knows the "
                             "Step-3.5/3.7 text decoder fields (see models/step37/config.py)")
        vision = {}
        if raw.get("vision_config"):
            vision = dict(vision=Step37VisionConfig.from_hf(raw["vision_config"]),
                          image_token_id=raw.get("image_token_id"),
                          projector_bias=bool(raw.get("projector_bias", False)))
        return cls(**{**_fields_from_hf(cfg), **vision, **overrides})

    def to_hf(self) -> dict:
        """A ``config.json`` dict in the form transformers' Step3p7TextConfig writes and reads."""
        D, L = self.num_mtp_layers, self.num_layers
        out = {
            "architectures": ["Step3p7TextModel"], "model_type": "step3p5",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": L,
            "num_attention_heads": self.num_attention_heads,
            "num_sliding_attention_heads": self.num_sliding_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "layer_types": list(self.layer_types), "mlp_layer_types": list(self.mlp_layer_types),
            "sliding_window": self.sliding_window, "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "share_expert_dim": self.shared_expert_size,
            "moe_router_scaling_factor": self.moe_router_scaling_factor,
            "swiglu_limits": [0 if v is None else v for v in self.swiglu_limits],
            "swiglu_limits_shared": [0 if v is None else v for v in self.swiglu_limits_shared],
            "rope_parameters": copy.deepcopy(self.rope_parameters),
            "query_pre_attn_scalar": self.query_pre_attn_scalar, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": D, "tie_word_embeddings": False,
            "need_fp32_gate": self.need_fp32_gate,
            "per_layer_config": {str(i): {"num_attention_heads": self.num_sliding_attention_heads}
                                 for i, t in enumerate(self.layer_types) if t == "sliding_attention"},
        }
        if D:
            out["mtp_layer_types"] = list(self.mtp_layer_types)
            out["mtp_mlp_layer_types"] = list(self.mtp_mlp_layer_types)
            # MTP clamps ride as trailing entries, the way the hub publishes per-layer lists
            out["swiglu_limits"] += [0 if v is None else v for v in self.mtp_swiglu_limits]
            out["swiglu_limits_shared"] += [0 if v is None else v for v in self.mtp_swiglu_limits_shared]
        if self.vision is None:
            return out
        vlm = {"architectures": ["Step3p7ForConditionalGeneration"], "model_type": "step3p7",
               "text_config": {k: v for k, v in out.items() if k != "architectures"},
               "vision_config": self.vision.to_hf(), "projector_bias": self.projector_bias}
        if self.image_token_id is not None:  # else the tokenizer's <im_patch> (transformers' default)
            vlm["image_token_id"] = self.image_token_id
        return vlm

    def to_dict(self) -> dict:
        return asdict(self)


def _limits(values, n_total: int) -> list:
    if not values:
        return [None] * n_total
    return [None if not v else float(v) for v in values]


def _split(values: list, L: int, D: int, what: str) -> tuple[list, list]:
    """Per-layer lists come either with L entries or padded with D trailing MTP entries."""
    if len(values) == L + D:
        return values[:L], values[L:]
    if len(values) == L:
        return values, []
    raise ValueError(f"config.json: {what} has {len(values)} entries; expected {L} layers "
                     f"(or {L + D} with the MTP layers)")


def _fields_from_hf(c: dict) -> dict:
    L = c["num_hidden_layers"]
    D = int(c.get("num_nextn_predict_layers", c.get("num_mtp_layers", 0)) or 0)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    layer_types, mtp_types = _split(c.get("layer_types") or ["full_attention"] * (L + D), L, D, "layer_types")
    mtp_types = c.get("mtp_layer_types") or mtp_types or ["sliding_attention"] * D
    if c.get("mlp_layer_types"):
        mlp_types, mtp_mlp = _split(c["mlp_layer_types"], L, D, "mlp_layer_types")
    else:
        enum = c.get("moe_layers_enum")
        if enum is None:
            moe = set(range(3, L))
        else:
            items = enum.split(",") if isinstance(enum, str) else enum
            moe = {int(i) for i in items if str(i).strip()}
        mlp_types = ["sparse" if i in moe else "dense" for i in range(L)]
        mtp_mlp = ["sparse" if i in moe else "dense" for i in range(L, L + D)]
    mtp_mlp = c.get("mtp_mlp_layer_types") or mtp_mlp or ["dense"] * D

    sliding_heads = c.get("num_sliding_attention_heads")
    if sliding_heads is None:
        sliding_heads = (c.get("attention_other_setting") or {}).get("num_attention_heads",
                                                                     c["num_attention_heads"])
    routed, mtp_routed = _split(_limits(c.get("swiglu_limits"), L), L, D, "swiglu_limits")
    shared, mtp_shared = _split(_limits(c.get("swiglu_limits_shared"), L), L, D, "swiglu_limits_shared")
    mtp_routed, mtp_shared = mtp_routed or [None] * D, mtp_shared or [None] * D
    return dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_layers=L,
        num_attention_heads=c["num_attention_heads"], num_sliding_attention_heads=sliding_heads,
        num_key_value_heads=c.get("num_key_value_heads", c.get("num_attention_groups")),
        head_dim=head_dim, layer_types=layer_types, sliding_window=c.get("sliding_window") or 512,
        mlp_layer_types=mlp_types, intermediate_size=c["intermediate_size"],
        moe_intermediate_size=c.get("moe_intermediate_size", 1280),
        num_experts=c.get("n_routed_experts", c.get("moe_num_experts", c.get("num_local_experts", 288))),
        num_experts_per_tok=c.get("num_experts_per_tok", c.get("moe_top_k", 8)),
        shared_expert_size=c.get("share_expert_dim", c.get("share_expert_dims", 1280)),
        moe_router_scaling_factor=float(c.get("moe_router_scaling_factor", 1.0)),
        swiglu_limits=routed, swiglu_limits_shared=shared,
        rope_parameters=_rope_from_hf(c, layer_types + mtp_types, L, D),
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or head_dim),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=c.get("max_position_embeddings") or c.get("max_seq_len") or 262144,
        num_mtp_layers=D, mtp_layer_types=mtp_types, mtp_mlp_layer_types=mtp_mlp,
        mtp_swiglu_limits=mtp_routed, mtp_swiglu_limits_shared=mtp_shared,
        need_fp32_gate=bool(c.get("need_fp32_gate", True)),
    )


def _rope_from_hf(c: dict, all_types: list, L: int, D: int) -> dict:
    rp = c.get("rope_parameters") or {}
    types = set(all_types)
    if rp and all(isinstance(rp.get(t), dict) for t in types):
        return {t: dict(rp[t]) for t in types}
    theta = c.get("rope_theta", 10000.0)
    thetas = theta if isinstance(theta, list) else [theta] * (L + D)
    factors = c.get("partial_rotary_factors") or [1.0] * (L + D)
    if len(thetas) not in (L, L + D) or len(factors) not in (L, L + D):
        raise ValueError(f"config.json: rope_theta / partial_rotary_factors need {L} or {L + D} entries")
    out = {}
    for t in types:
        i = all_types.index(t)
        if i >= len(thetas):
            i = all_types[:L].index(t) if t in all_types[:L] else 0
        values = [(thetas[j], factors[j]) for j, tj in enumerate(all_types[:len(thetas)]) if tj == t]
        if len(set(values)) > 1:
            raise ValueError(f"config.json: layers of type {t} disagree on rope_theta / "
                             f"partial_rotary_factors ({sorted(set(values))}); one value per type is supported")
        out[t] = {"rope_type": "default", "rope_theta": float(thetas[i]),
                  "partial_rotary_factor": float(factors[i])}
    scaling = c.get("rope_scaling")
    if scaling and "full_attention" in out:  # rope_scaling applies to full-attention layers only
        out["full_attention"].update(scaling)
        out["full_attention"]["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        out["full_attention"].pop("type", None)
    return out


def _flash_config() -> dict:
    """Step-3.7-Flash's text decoder, in the hub's legacy form (45 layers + 3 MTP)."""
    L, D = 45, 3
    types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(L + D)]
    return {
        "vocab_size": 128896, "hidden_size": 4096, "intermediate_size": 11264,
        "num_hidden_layers": L, "num_attention_heads": 64, "num_attention_groups": 8,
        "head_dim": 128, "layer_types": types, "sliding_window": 512,
        "attention_other_setting": {"num_attention_heads": 96, "num_attention_groups": 8},
        "moe_layers_enum": ",".join(str(i) for i in range(3, L)),
        "moe_num_experts": 288, "moe_top_k": 8, "moe_intermediate_size": 1280,
        "share_expert_dim": 1280, "moe_router_scaling_factor": 3.0,
        "rope_theta": [5e6 if t == "full_attention" else 1e4 for t in types],
        "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in types],
        "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 32.0, "original_max_position_embeddings": 131072},
        "swiglu_limits": [0.0] * 43 + [7.0, 7.0] + [0.0] * D,
        "swiglu_limits_shared": [0.0] * 43 + [16.0, 16.0] + [0.0] * D,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": D,
    }


def _tiny_config() -> dict:
    """CPU-sized, every feature on: both attention types, dense and MoE, clamps, partial rotary,
    llama3 scaling, MTP. Sizes are multiples of 8 so grouped_mm runs on CPU."""
    L, D = 4, 2
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention",
             "sliding_attention", "sliding_attention"]
    return {
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": L,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "layer_types": types,
        "sliding_window": 8, "attention_other_setting": {"num_attention_heads": 6},
        "moe_layers_enum": "1,2,3", "moe_num_experts": 8, "moe_top_k": 2,
        "moe_intermediate_size": 32, "share_expert_dim": 32, "moe_router_scaling_factor": 3.0,
        "rope_theta": [5e6 if t == "full_attention" else 1e4 for t in types],
        "partial_rotary_factors": [0.5 if t == "full_attention" else 1.0 for t in types],
        "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        "swiglu_limits": [0, 0, 0, 0.5, 0, 0], "swiglu_limits_shared": [0.5, 0, 0, 0.5, 0, 0],
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": D,
    }


def _tiny_vlm_config() -> dict:
    """The tiny decoder with a 2-layer vision tower: 112-pixel global views (8 x 8 patches of
    14, 4 features after the downsamplers), any multiple of 14 for crops. Its vocabulary (400)
    and image placeholder (3, ``<im_patch>``) are the test processor's
    (``tests/fixtures/step3p7_processor``, whose 112-pixel global views and 56-pixel crops give
    4 and 1 features here), so that folder's datasets train this preset as they are."""
    return {"model_type": "step3p7", "text_config": {**_tiny_config(), "vocab_size": 400}, "image_token_id": 3,
            "projector_bias": False,
            "vision_config": {"width": 32, "layers": 2, "heads": 2, "image_size": 112, "patch_size": 14,
                              "hidden_act": "quick_gelu", "ls_init_value": 0.1}}


def _flash_vlm_config() -> dict:
    """Step-3.7-Flash whole: the text decoder above with its vision tower (transformers'
    Step3p7VisionConfig defaults: 47 layers of 1536, 16 heads, 728-pixel views, patches of 14).
    The placeholder token id is the tokenizer's ``<im_patch>`` (not part of this preset)."""
    return {"model_type": "step3p7", "text_config": _flash_config(), "projector_bias": False,
            "vision_config": {"width": 1536, "layers": 47, "heads": 16, "image_size": 728, "patch_size": 14,
                              "mlp_ratio": 8960 / 1536, "hidden_act": "quick_gelu", "ls_init_value": 0.1}}


PRESETS = {"step37-flash": _flash_config(), "tiny": _tiny_config(), "step37-tiny-vlm": _tiny_vlm_config(),
           "step37-flash-vlm": _flash_vlm_config()}
