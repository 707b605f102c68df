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
| ``mtp.k.{enorm,hnorm,eh_proj}.weight`` | ``model.layers.{L+k}.{enorm,hnorm,eh_proj}.weight`` | (transformers builds no MTP layer) |
| ``mtp.k.block.*``                  | ``model.layers.{L+k}.*``, the rows above |                             |
| ``mtp.k.head_norm.weight``         | ``model.layers.{L+k}.shared_head.norm.weight`` |                      |
| ``mtp.k.head.weight``              | ``model.layers.{L+k}.shared_head.head.weight`` |                      |
| (the main ``embed_tokens``)        | ``model.layers.{L+k}.embed_tokens.weight`` |                          |

plus ``model.embed_tokens``, ``model.norm`` and ``lm_head``. Names are also accepted without the
``model.`` prefix (a saved base model). ``L`` = ``num_hidden_layers``, ``k`` <
``num_nextn_predict_layers`` (DeepSeek-V3: layer 61). A depth reads the main input embedding
(DeepSeek-V3 shares it): the checkpoint's copy, ``model.layers.{L+k}.embed_tokens.weight``, is
set aside on import, and export writes the main embedding there, as the release holds it. The
depth's head is a tensor of its own (core's MTP block). A checkpoint folder without the
layer (transformers' ``save_pretrained`` writes the count but not the layer) is read as holding
none (``models/common/mtp_layers.py``, as GLM-4.5's); one that holds part of a depth is refused,
naming what is missing. FP8 weights (``float8_e4m3fn`` + ``weight_scale_inv``) are dequantized by the reader
(``core/hf_checkpoint.py``). Export writes the published layout, which transformers loads as is.
"""
from __future__ import annotations

import re

from core.hf_checkpoint import Exported, Source

TOP = {"embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight"),
       "norm.weight": ("model.norm.weight", "norm.weight"), "lm_head.weight": ("lm_head.weight",)}
PREFIXES = ("model.layers.", "layers.")
_MTP_HEAD = {"head_norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"}


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
        # each MTP depth's copy of the input embedding: the depths read the main one
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
            [Source(_MTP_HEAD.get(rest, rest))]
        return [Source(p + layer + "." + s.name, s.half) for p in PREFIXES for s in inner]

    def published(self, name: str) -> str:
        return self.sources(name)[0].name.replace("{e}", "E")

    def export(self, state: dict, src) -> Exported:
        # each MTP depth's embedding: the main one, copied (safetensors writes no shared storage)
        tensors = {f"model.layers.{i}.embed_tokens.weight": state["embed_tokens.weight"].clone()
                   for i in self._mtp_layers()}
        for name, t in state.items():
            first = self.sources(name)[0]
            if first.per_expert:  # one tensor per expert, as the hub and save_pretrained have them
                tensors.update({first.name.format(e=e): t[e] for e in range(t.shape[0])})
            else:
                tensors[first.name] = t
        return Exported(tensors, self.config.to_hf(), "published")
