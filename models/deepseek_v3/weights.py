"""DeepSeek-V3's Hugging Face weight names, both ways (the adapter ``core/hf_checkpoint.py`` reads
and writes through).

| ours (``layers.N.`` ...)            | published (hub, ``save_pretrained``) | transformers in memory         |
| ---                                | ---                                  | ---                            |
| ``self_attn.*`` (MLA), norms, dense ``mlp.*`` | same under ``model.layers.N.`` | same                          |
| ``mlp.router.weight``              | ``mlp.gate.weight``                  | same                           |
| ``mlp.router.e_score_correction_bias`` | ``mlp.gate.e_score_correction_bias`` | same                       |
| ``mlp.experts.{gate,up}_proj`` [E, I, H] | ``mlp.experts.{e}.{gate,up}_proj.weight``, one per expert | halves of ``mlp.experts.gate_up_proj`` [E, 2I, H] |
| ``mlp.experts.down_proj`` [E, H, I] | ``mlp.experts.{e}.down_proj.weight`` | ``mlp.experts.down_proj``      |
| ``mlp.shared_expert.*``            | ``mlp.shared_experts.*``             | same as published              |

plus ``model.embed_tokens``, ``model.norm`` and ``lm_head``. Names are also accepted without the
``model.`` prefix (a saved base model). The multi-token-prediction layers a release holds after
the last layer (``model.layers.{L}.*`` .. ``model.layers.{L + n - 1}.*``, ``n`` =
``num_nextn_predict_layers``: DeepSeek-V3's layer 61) are set aside on import and not exported.
FP8 weights (``float8_e4m3fn`` + ``weight_scale_inv``) are dequantized by the reader
(``core/hf_checkpoint.py``). Export writes the published layout, which transformers loads as is.
"""
from __future__ import annotations

import re

from core.hf_checkpoint import Exported, Source

TOP = {"embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight"),
       "norm.weight": ("model.norm.weight", "norm.weight"), "lm_head.weight": ("lm_head.weight",)}
PREFIXES = ("model.layers.", "layers.")


def _layer_sources(rest: str) -> list[Source]:
    m = re.fullmatch(r"mlp\.experts\.(gate|up|down)_proj", rest)
    if m:
        part = m.group(1)
        fused = [Source("mlp.experts.down_proj")] if part == "down" else [Source("mlp.experts.gate_up_proj", part)]
        return [Source(f"mlp.experts.{{e}}.{part}_proj.weight"), *fused]
    if rest.startswith("mlp.router."):
        return [Source("mlp.gate." + rest[len("mlp.router."):])]
    if rest.startswith("mlp.shared_expert."):
        return [Source("mlp.shared_experts." + rest[len("mlp.shared_expert."):])]
    return [Source(rest)]


class DeepseekV3Weights:
    """The adapter of one config: sources per parameter, published names, export."""

    side_files = ()
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        self.config = config
        L = config.num_layers
        # the MTP layers after the last one: set aside (transformers skips them too)
        self.kept_prefixes = tuple(f"{p}{L + k}." for k in range(config.num_nextn_predict_layers)
                                   for p in PREFIXES)

    def sources(self, name: str) -> list[Source]:
        if name in TOP:
            return [Source(c) for c in TOP[name]]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if not m:
            raise KeyError(f"no Hugging Face name is known for parameter {name!r}")
        return [Source(p + m.group(1) + "." + s.name, s.half) for p in PREFIXES for s in _layer_sources(m.group(2))]

    def published(self, name: str) -> str:
        return self.sources(name)[0].name.replace("{e}", "E")

    def export(self, state: dict, src) -> Exported:
        tensors = {}
        for name, t in state.items():
            first = self.sources(name)[0]
            if first.per_expert:  # one tensor per expert, as the hub and save_pretrained have them
                tensors.update({first.name.format(e=e): t[e] for e in range(t.shape[0])})
            else:
                tensors[first.name] = t
        return Exported(tensors, self.config.to_hf(), "published")
