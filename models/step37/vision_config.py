"""Step37VisionConfig: Step-3.7's vision tower (a Perception-Encoder ViT with 2-D RoPE, layer
scale and two stride-2 convolution downsamplers), read from a published ``vision_config``.

Both spellings are read: the hub's remote-code form (``width``, ``layers``, ``heads``,
``ls_init_value``, ``use_*`` switches) and what transformers' ``Step3p7VisionConfig`` writes
(``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``layer_scale_init_value``,
``rope_parameters``). As in transformers, the MLP width is ``int(hidden_size * mlp_ratio)``
(a written ``intermediate_size`` is derived, not read). Switches that select another design than
the one built here (a class token, a final LayerNorm, no 2-D RoPE...) are refused by name.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

_ALIASES = {"width": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
            "ls_init_value": "layer_scale_init_value"}
# the one design built here: these switches must have these values when present
_REQUIRED = {"use_cls_token": False, "use_ln_pre": True, "use_ln_post": False, "use_abs_posemb": True,
             "use_rope2d": True}
_IGNORED = {"model_type", "architectures", "transformers_version", "dtype", "torch_dtype",
            "attention_dropout", "intermediate_size", "max_position_embeddings", "output_dim",
            "initializer_range", "_name_or_path"}
_READ = {"hidden_size", "num_hidden_layers", "num_attention_heads", "layer_scale_init_value",
         "mlp_ratio", "image_size", "patch_size", "num_channels", "hidden_act", "layer_norm_eps",
         "rope_parameters", "rope_theta"}
FLASH_MLP_RATIO = 8960 / 1536


@dataclass
class Step37VisionConfig:
    hidden_size: int = 1536
    num_layers: int = 47
    num_heads: int = 16
    mlp_ratio: float = FLASH_MLP_RATIO
    image_size: int = 728            # the global view; the position table is (image_size / patch)^2
    patch_size: int = 14
    num_channels: int = 3
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    layer_scale_init: float = 0.1
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision_config: hidden size {self.hidden_size} over {self.num_heads} heads must "
                             "give a head size divisible by 4 (2-D RoPE rotates pairs on two axes)")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config: image_size {self.image_size} is not a multiple of "
                             f"patch_size {self.patch_size}")

    @property
    def intermediate_size(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)  # transformers' rule

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def out_size(self) -> int:
        """Channels after the two downsamplers (each doubles them)."""
        return 4 * self.hidden_size

    def features(self, side: int) -> int:
        """Features one square view of ``side`` pixels gives (two stride-2 convolutions, pad 1)."""
        g = side // self.patch_size
        for _ in range(2):
            g = (g + 1) // 2
        return g * g

    @classmethod
    def from_hf(cls, raw: dict) -> "Step37VisionConfig":
        c = {_ALIASES.get(k, k): v for k, v in raw.items()}
        unknown = sorted(set(c) - _READ - _IGNORED - set(_REQUIRED))
        if unknown:
            raise ValueError(f"config.json: vision_config has unknown field(s) {unknown} "
                             "(see models/step37/vision_config.py)")
        for key, want in _REQUIRED.items():
            if key in c and bool(c[key]) != want:
                raise ValueError(f"config.json: vision_config.{key}={c[key]!r} selects a vision tower this "
                                 f"reader does not build (it needs {want})")
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"config.json: vision_config rope_type {rope['rope_type']!r}: only 'axial' is supported")
        d = cls()
        return cls(hidden_size=c.get("hidden_size", d.hidden_size),
                   num_layers=c.get("num_hidden_layers", d.num_layers),
                   num_heads=c.get("num_attention_heads", d.num_heads),
                   mlp_ratio=float(c.get("mlp_ratio", d.mlp_ratio)),
                   image_size=c.get("image_size", d.image_size), patch_size=c.get("patch_size", d.patch_size),
                   num_channels=c.get("num_channels", d.num_channels), hidden_act=c.get("hidden_act", d.hidden_act),
                   layer_norm_eps=float(c.get("layer_norm_eps", d.layer_norm_eps)),
                   layer_scale_init=float(c.get("layer_scale_init_value", d.layer_scale_init)),
                   rope_theta=float(rope.get("rope_theta", c.get("rope_theta", d.rope_theta))))

    def to_hf(self) -> dict:
        """The form transformers' ``Step3p7VisionConfig`` writes."""
        return {"model_type": "step3p5_vision", "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "mlp_ratio": self.mlp_ratio, "intermediate_size": self.intermediate_size,
                "image_size": self.image_size, "patch_size": self.patch_size,
                "num_channels": self.num_channels, "hidden_act": self.hidden_act,
                "layer_norm_eps": self.layer_norm_eps, "layer_scale_init_value": self.layer_scale_init,
                "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta}}

    def to_dict(self) -> dict:
        return asdict(self)
