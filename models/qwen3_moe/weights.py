"""Qwen3-MoE's Hugging Face weight names, both ways (the adapter ``core/checkpoint/hf.py`` reads
and writes through).

| ours (``layers.N.`` ...)            | published (hub, ``save_pretrained``) | transformers in memory         |
| ---                                | ---                                  | ---                            |
| ``self_attn.*``, norms, dense ``mlp.*`` | same under ``model.layers.N.``   | same                           |
| ``mlp.router.weight``              | ``mlp.gate.weight``                  | same                           |
| ``mlp.experts.{gate,up}_proj`` [E, I, H] | ``mlp.experts.{e}.{gate,up}_proj.weight``, one per expert | halves of ``mlp.experts.gate_up_proj`` [E, 2I, H] |
| ``mlp.experts.down_proj`` [E, H, I] | ``mlp.experts.{e}.down_proj.weight`` | ``mlp.experts.down_proj``      |

plus ``model.embed_tokens``, ``model.norm`` and ``lm_head`` (absent with tied embeddings: the head
is the embedding). Names are also accepted without the ``model.`` prefix (a saved base model).
Export writes the published layout, which transformers loads as is.
"""
from __future__ import annotations

import re

from core.checkpoint.hf import Exported, Source

TOP = {"embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight"),
       "norm.weight": ("model.norm.weight", "norm.weight"), "lm_head.weight": ("lm_head.weight",)}
PREFIXES = ("model.layers.", "layers.")


def _layer_sources(rest: str) -> list[Source]:
    m = re.fullmatch(r"mlp\.experts\.(gate|up|down)_proj", rest)
    if m:
        part = m.group(1)
        fused = [Source("mlp.experts.down_proj")] if part == "down" else [Source("mlp.experts.gate_up_proj", part)]
        return [Source(f"mlp.experts.{{e}}.{part}_proj.weight"), *fused]
    if rest == "mlp.router.weight":
        return [Source("mlp.gate.weight")]
    return [Source(rest)]


class Qwen3MoeWeights:
    """The adapter of one config: sources per parameter, published names, export."""

    side_files = ()
    kept_prefixes = ()
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        self.config = config

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
