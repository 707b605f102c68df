"""Step-3.7's blocks as shapes (``core/costs/shapes.py``): what the FLOP model, the activation-byte
model and the planner read of it. Attention is gated GQA with partial rotary on full layers;
dense layers clamp with the shared-expert limits; MoE layers have a shared expert; each MTP depth
is a decoder layer with an ``eh_proj`` input projection (2 x hidden) and its own head.

The vision tower (``vision_settings``): transformers' ``Step3p7VisionModel``, read from the
config's ``vision_config`` (a dict of HF keys) when it has one, else the published defaults
(``Step3p7VisionConfig``: Step-3.7-Flash's tower); global view 728, crops 504 (the image
processor's ``size`` and ``patch_size``), two 3 x 3 stride-2 downsamplers doubling the
channels, a projector ``4 x hidden -> text hidden``."""
from __future__ import annotations

from core.transformer.rotary import rotary_dim
from core.costs.shapes import AttentionShape, BlockShape, FFNShape, ModelShapes, VisionShape
from models.step37.config import Step37Config


def _block(cfg: Step37Config, layer_type: str, mlp_type: str, limit, shared_limit, **extra) -> BlockShape:
    window = cfg.sliding_window if layer_type == "sliding_attention" else None
    attn = AttentionShape(cfg.num_heads(layer_type), cfg.num_key_value_heads, cfg.head_dim, window, gate=True,
                          rotary_dim=rotary_dim(cfg.head_dim, cfg.rope_parameters[layer_type]))
    if mlp_type == "dense":
        ffn = FFNShape("dense", cfg.intermediate_size, clamped=shared_limit is not None)
    else:
        ffn = FFNShape("moe", cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                       cfg.shared_expert_size, clamped=limit is not None, shared_clamped=shared_limit is not None)
    return BlockShape(attn, ffn, **extra)


# Step3p7VisionConfig's defaults (transformers 5.24) and the image processor's view sizes
VISION_DEFAULTS = {"hidden_size": 1536, "mlp_ratio": 8960 / 1536, "num_hidden_layers": 47, "num_attention_heads": 16,
                   "patch_size": 14, "image_size": 728, "num_channels": 3}
# Step3p7ImageProcessor.patch_size: a local crop's side in pixels (the processor's setting, not the
# tower's: for towers of smaller views, half the view, as the tests' tiny processor has it: 112, 56)
CROP_SIZE = 504


def vision_settings(cfg) -> dict:
    """The tower's settings: ``cfg.vision_config`` (HF keys; ``width`` / ``layers`` / ``heads``
    accepted as transformers does) over the published defaults; ``intermediate_size`` as
    transformers derives it, ``int(hidden x mlp_ratio)``, unless given."""
    parsed = getattr(cfg, "vision", None)  # the model's own reading of a VLM config (vision_config.py)
    if parsed is not None:
        return {"hidden_size": parsed.hidden_size, "num_hidden_layers": parsed.num_layers,
                "num_attention_heads": parsed.num_heads, "patch_size": parsed.patch_size,
                "image_size": parsed.image_size, "num_channels": parsed.num_channels,
                "intermediate_size": parsed.intermediate_size, "mlp_ratio": parsed.mlp_ratio}
    vc = getattr(cfg, "vision_config", None)
    given = dict(vc) if isinstance(vc, dict) else dict(vars(vc)) if vc is not None else {}
    for old, new in (("width", "hidden_size"), ("layers", "num_hidden_layers"), ("heads", "num_attention_heads")):
        if old in given:
            given.setdefault(new, given.pop(old))
    out = {**VISION_DEFAULTS, **given}
    out.setdefault("intermediate_size", int(out["hidden_size"] * out["mlp_ratio"]))
    return out


def vision_shape(cfg) -> VisionShape:
    """The tower, downsamplers and projector as shapes (``core.costs.shapes.VisionShape``)."""
    v = vision_settings(cfg)
    H, patch, size = v["hidden_size"], v["patch_size"], v["image_size"]
    return VisionShape(H, v["intermediate_size"], v["num_hidden_layers"], v["num_attention_heads"], patch, size,
                       crop_size=CROP_SIZE if size > CROP_SIZE else size // 2, channels=v.get("num_channels", 3),
                       positions=(size // patch) ** 2, downsamplers=((2 * H, 3, 2, 1), (4 * H, 3, 2, 1)),
                       out_hidden=cfg.hidden_size, projector_bias=bool(getattr(cfg, "projector_bias", False)))


def model_shapes(cfg: Step37Config) -> ModelShapes:
    blocks = tuple(_block(cfg, cfg.layer_types[i], cfg.mlp_layer_types[i], cfg.swiglu_limits[i],
                          cfg.swiglu_limits_shared[i]) for i in range(cfg.num_layers))
    extra = tuple(_block(cfg, cfg.mtp_layer_types[k], cfg.mtp_mlp_layer_types[k], cfg.mtp_swiglu_limits[k],
                         cfg.mtp_swiglu_limits_shared[k], input_proj=2 * cfg.hidden_size, head=True)
                  for k in range(cfg.num_mtp_layers))
    return ModelShapes(cfg.hidden_size, cfg.vocab_size, blocks, extra, vision_shape(cfg))
