"""The published weight layout DeepSeek-V3 introduced and GLM-4.5 kept, both ways (the adapter
``core/checkpoint/hf.py`` reads and writes through). ``L`` = ``num_hidden_layers``; ``M`` =
``model.layers.{L + k}.``, multi-token-prediction layer ``k``.

| ours (``layers.N.`` ...)             | published (hub, ``save_pretrained``) | transformers in memory          |
| ---                                  | ---                                  | ---                             |
| ``self_attn.*``, norms, dense ``mlp.*`` | same under ``model.layers.N.``    | same                            |
| ``mlp.router.weight``                | ``mlp.gate.weight``                  | same                            |
| ``mlp.router.e_score_correction_bias`` | ``mlp.gate.e_score_correction_bias`` | same                        |
| ``mlp.experts.{gate,up}_proj`` [E, I, H] | ``mlp.experts.{e}.{gate,up}_proj.weight``, one per expert | halves of ``mlp.experts.gate_up_proj`` [E, 2I, H] |
| ``mlp.experts.down_proj`` [E, H, I]  | ``mlp.experts.{e}.down_proj.weight`` | ``mlp.experts.down_proj``       |
| ``mlp.shared_expert.*``              | ``mlp.shared_experts.*``             | same as published               |
| ``mtp.k.{enorm,hnorm,eh_proj}``      | ``M {enorm,hnorm,eh_proj}.weight``   | (transformers builds no MTP)    |
| ``mtp.k.block.*``                    | ``M *`` (a decoder layer's names)    |                                 |
| ``mtp.k.head_norm`` / ``mtp.k.head`` | ``M shared_head.norm.weight`` / ``M shared_head.head.weight`` |           |
| (the main ``embed_tokens``)          | ``M embed_tokens.weight``            |                                 |

plus ``model.embed_tokens``, ``model.norm`` and ``lm_head``. Names are also accepted without the
``model.`` prefix (a saved base model).

An MTP layer holds its own ``embed_tokens`` and ``shared_head.head``. Core's MTP block embeds
with the main model's embedding (DeepSeek-V3's design, which GLM-4.5 follows), so ``M
embed_tokens`` is set aside on import, and export writes the main embedding there: what the depth
computed with, and what the releases hold (their copy equals the main embedding), so a release
round-trips byte for byte. ``shared_head.head`` is the depth's own head (trained as such; a
checkpoint without it gives the depth the main ``lm_head``). A folder that declares MTP layers
but holds none (transformers' ``save_pretrained``) is read as holding none
(``models/common/mtp_layers.py``). A PEFT export leaves the MTP layers' modules out
(``peft_module``): transformers builds none.
"""
from __future__ import annotations

import re

from core.checkpoint.hf import Exported, Source

TOP = {"embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight"),
       "norm.weight": ("model.norm.weight", "norm.weight"), "lm_head.weight": ("lm_head.weight",)}
PREFIXES = ("model.layers.", "layers.")
_MTP_OWN = {"head_norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"}


def _layer_sources(rest: str) -> list[Source]:
    """Names within one decoder layer (a main layer or an MTP layer's block)."""
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


class NextNLayout:
    """The adapter of one config (``num_layers``, ``num_mtp_layers``): sources per parameter,
    published names, PEFT module names, export."""

    side_files = ()
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        self.config = config
        # each MTP layer's copy of the input embedding: set aside (the depths read the main one)
        self.kept_prefixes = tuple(f"{p}{i}.embed_tokens." for i in self._mtp_layers() for p in PREFIXES)

    def _mtp_layers(self) -> range:
        return range(self.config.num_layers, self.config.num_layers + self.config.num_mtp_layers)

    def sources(self, name: str) -> list[Source]:
        if name in TOP:
            return [Source(c) for c in TOP[name]]
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m:
            return [Source(p + m.group(1) + "." + s.name, s.half) for p in PREFIXES
                    for s in _layer_sources(m.group(2))]
        m = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
        if not m:
            raise KeyError(f"no Hugging Face name is known for parameter {name!r}")
        layer, rest = str(self.config.num_layers + int(m.group(1))), m.group(2)
        inner = _layer_sources(rest[len("block."):]) if rest.startswith("block.") else \
            [Source(_MTP_OWN.get(rest, rest))]
        out = [Source(p + layer + "." + s.name, s.half) for p in PREFIXES for s in inner]
        return out + ([Source("lm_head.weight")] if rest == "head.weight" else [])

    def published(self, name: str) -> str:
        return self.sources(name)[0].name.replace("{e}", "E")

    def peft_module(self, name: str) -> str | None:
        """transformers' module path (for PEFT) of our linear weight ``name``; None for an MTP
        layer's (transformers builds no MTP modules)."""
        if name.startswith("mtp."):
            return None
        published = self.sources(name)[0].name
        return published[:-len(".weight")] if published.endswith(".weight") else None

    def export(self, state: dict, src) -> Exported:
        # each MTP layer's embedding: the main one, copied (safetensors writes no shared storage)
        tensors = {f"model.layers.{i}.embed_tokens.weight": state["embed_tokens.weight"].clone()
                   for i in self._mtp_layers()}
        for name, t in state.items():
            first = self.sources(name)[0]
            if first.per_expert:  # one tensor per expert, as the hub and save_pretrained have them
                tensors.update({first.name.format(e=e): t[e] for e in range(t.shape[0])})
            else:
                tensors[first.name] = t
        return Exported(tensors, self.config.to_hf(), "published")
