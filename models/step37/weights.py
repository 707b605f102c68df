"""Step-3.7's Hugging Face weight names, both ways (the adapter ``core/checkpoint/hf.py`` reads
and writes through).

Names read (``P`` = ``model.layers.N.``; also accepted with ``model.language_model.`` or no
prefix, as transformers writes them from memory):

| ours (``layers.N.`` ...)            | published                         | transformers in memory              |
| ---                                | ---                               | ---                                 |
| ``self_attn.*``, norms, dense ``mlp.*`` | same under ``P``              | same                                |
| ``moe.router.weight``              | ``P moe.gate.weight``             | ``mlp.gate.weight``                 |
| ``moe.router.e_score_correction_bias`` | ``P moe.router_bias``         | ``mlp.gate.e_score_correction_bias``|
| ``moe.experts.{gate,up}_proj`` [E, I, H] | ``P moe.{gate,up}_proj.weight`` | halves of ``mlp.experts.gate_up_proj`` [E, 2I, H] |
| ``moe.experts.down_proj`` [E, H, I] | ``P moe.down_proj.weight``       | ``mlp.experts.down_proj``           |
| ``moe.shared_expert.*``            | ``P share_expert.*``              | ``mlp.shared_experts.*``            |
| ``mtp.k.{enorm,hnorm,eh_proj}``    | ``model.layers.{L+k}.{...}.weight`` | (transformers skips MTP layers)   |
| ``mtp.k.block.*``                  | ``model.layers.{L+k}.*``          |                                     |
| ``mtp.k.head_norm`` / ``mtp.k.head`` | ``model.layers.{L+k}.transformer.shared_head.{norm,output}.weight`` | |

plus ``model.embed_tokens``, ``model.norm``, ``lm_head``; an MTP depth without its own output
head takes the main ``lm_head`` (checkpoints that share it).

The vision tower and projector (a model whose config has a vision tower), by the names the
release and ``Step3p7ForConditionalGeneration.save_pretrained`` both write (``V`` =
``vision_model.``, ``B`` = ``V transformer.resblocks.N.``):

| ours (``vision_model.`` ...)        | published                         |
| ---                                | ---                               |
| ``patch_embed.weight``, ``pos_embed`` | ``V conv1.weight``, ``V positional_embedding`` |
| ``pre_norm.*``                     | ``V ln_pre.*``                    |
| ``blocks.N.norm1.*`` / ``norm2.*``  | ``B ln_1.*`` / ``B ln_2.*``        |
| ``blocks.N.attn.qkv.{weight,bias}`` | ``B attn.in_proj_{weight,bias}`` (rows q, k, v; RoPE pairs interleaved) |
| ``blocks.N.attn.proj.*``            | ``B attn.out_proj.*``              |
| ``blocks.N.mlp.fc1.*`` / ``fc2.*``  | ``B mlp.c_fc.*`` / ``B mlp.c_proj.*`` |
| ``blocks.N.scale1.gamma`` / ``scale2`` | ``B ls_1.gamma`` / ``B ls_2.gamma`` |
| ``downsample1.*`` / ``downsample2.*`` | ``V vit_downsampler1.*`` / ``V vit_downsampler2.*`` |
| ``multi_modal_projector.*`` (top level) | ``vit_large_projector.*``     |

A text-only model (no vision tower in its config) keeps these tensors aside on import and copies
them byte for byte into a published export.

Export writes the published layout when the source checkpoint had it (the Step-3.7 release and
what ``Step3p7ForConditionalGeneration.save_pretrained`` writes; the vision tower is copied byte
for byte), else transformers' ``Step3p7TextModel`` layout, which has no output head: the head
and MTP depths then go beside it in ``step37_extra.safetensors``.
"""
from __future__ import annotations

import json
import os
import re

import torch

from core.checkpoint.hf import Exported, Source

PREFIXES = ("model.layers.", "model.language_model.layers.", "layers.")
TOP = {"embed_tokens.weight": ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                               "embed_tokens.weight"),
       "norm.weight": ("model.norm.weight", "model.language_model.norm.weight", "norm.weight"),
       "lm_head.weight": ("lm_head.weight",)}
EXTRA_FILE = "step37_extra.safetensors"
VISION_PREFIXES = ("vision_model.", "vit_large_projector.", "model.vision_model.",
                   "model.multi_modal_projector.")


_VISION_TOP = {"patch_embed.weight": "conv1.weight", "pos_embed": "positional_embedding"}
_VISION_RENAMES = (("pre_norm.", "ln_pre."), ("downsample1.", "vit_downsampler1."),
                   ("downsample2.", "vit_downsampler2."))
_VISION_BLOCK = (("norm1.", "ln_1."), ("norm2.", "ln_2."), ("attn.qkv.weight", "attn.in_proj_weight"),
                 ("attn.qkv.bias", "attn.in_proj_bias"), ("attn.proj.", "attn.out_proj."),
                 ("mlp.fc1.", "mlp.c_fc."), ("mlp.fc2.", "mlp.c_proj."), ("scale1.gamma", "ls_1.gamma"),
                 ("scale2.gamma", "ls_2.gamma"))


def vision_published(name: str) -> str | None:
    """The published name of a vision tower or projector parameter (None: not one)."""
    if name.startswith("multi_modal_projector."):
        return "vit_large_projector." + name[len("multi_modal_projector."):]
    if not name.startswith("vision_model."):
        return None
    rest = name[len("vision_model."):]
    if rest in _VISION_TOP:
        return "vision_model." + _VISION_TOP[rest]
    for ours, theirs in _VISION_RENAMES:
        if rest.startswith(ours):
            return "vision_model." + theirs + rest[len(ours):]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", rest)
    if m:
        for ours, theirs in _VISION_BLOCK:
            if m.group(2).startswith(ours):
                return f"vision_model.transformer.resblocks.{m.group(1)}.{theirs}{m.group(2)[len(ours):]}"
    raise KeyError(f"no Hugging Face name is known for vision parameter {name!r}")


def _layer_candidates(rest: str) -> list[tuple[str, str | None]]:
    """Names (within a layer) a parameter may have, with an optional half of dim 1."""
    m = re.fullmatch(r"moe\.experts\.(gate|up|down)_proj", rest)
    if m:
        part = m.group(1)
        fused = [] if part == "down" else [("mlp.experts.gate_up_proj", part)]
        return [(f"moe.{part}_proj.weight", None)] + fused + \
            ([("mlp.experts.down_proj", None)] if part == "down" else [])
    for ours, published, memory in (("moe.router.weight", "moe.gate.weight", "mlp.gate.weight"),
                                    ("moe.router.e_score_correction_bias", "moe.router_bias",
                                     "mlp.gate.e_score_correction_bias")):
        if rest == ours:
            return [(published, None), (memory, None)]
    if rest.startswith("moe.shared_expert."):
        tail = rest[len("moe.shared_expert."):]
        return [("share_expert." + tail, None), ("mlp.shared_experts." + tail, None)]
    return [(rest, None)]


def candidates(name: str, num_layers: int) -> list[tuple[str, str | None]]:
    """Checkpoint names (with an optional half of dim 1) that can supply our parameter
    ``name`` (first match wins)."""
    if name in TOP:
        return [(c, None) for c in TOP[name]]
    vision = vision_published(name)
    if vision is not None:
        return [(vision, None)]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m:
        return [(p + m.group(1) + "." + c, s) for p in PREFIXES for c, s in _layer_candidates(m.group(2))]
    m = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if m:
        idx, rest = str(num_layers + int(m.group(1))), m.group(2)
        if rest.startswith("block."):
            inner = _layer_candidates(rest[len("block."):])
        elif rest.startswith("head_norm."):
            inner = [("transformer.shared_head.norm.weight", None), ("shared_head.norm.weight", None)]
        elif rest.startswith("head."):
            inner = [("transformer.shared_head.output.weight", None), ("shared_head.output.weight", None),
                     ("shared_head.head.weight", None)]
        else:
            inner = [(rest, None)]
        out = [(p + idx + "." + c, s) for p in PREFIXES for c, s in inner]
        return out + ([("lm_head.weight", None)] if rest.startswith("head.") else [])
    raise KeyError(f"no Hugging Face name is known for parameter {name!r}")


def published_name(name: str, num_layers: int) -> str:
    """Our parameter name -> the published (hub release) name."""
    if name in TOP:
        return TOP[name][0]
    vision = vision_published(name)
    if vision is not None:
        return vision
    m = re.fullmatch(r"mtp\.(\d+)\.(.+)", name)
    if m:
        prefix, rest = f"model.layers.{num_layers + int(m.group(1))}.", m.group(2)
        if rest.startswith("head_norm."):
            return prefix + "transformer.shared_head.norm.weight"
        if rest.startswith("head."):
            return prefix + "transformer.shared_head.output.weight"
        rest = rest[len("block."):] if rest.startswith("block.") else rest
        return prefix + _layer_candidates(rest)[0][0]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    return f"model.layers.{m.group(1)}." + _layer_candidates(m.group(2))[0][0]


def _transformers_text_tensors(state: dict, num_layers: int) -> tuple[dict, dict]:
    """Step3p7TextModel layout (fused gate_up) for the main layers; head and MTP kept apart
    under their published names."""
    main, extra = {}, {}
    for name, t in state.items():
        if name == "lm_head.weight" or name.startswith("mtp."):
            extra[published_name(name, num_layers)] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.moe\.experts\.(gate|up|down)_proj", name)
        if m and m.group(2) == "gate":
            up = state[f"layers.{m.group(1)}.moe.experts.up_proj"]
            main[f"layers.{m.group(1)}.mlp.experts.gate_up_proj"] = torch.cat([t, up], dim=1)
        elif m and m.group(2) == "down":
            main[f"layers.{m.group(1)}.mlp.experts.down_proj"] = t
        elif not m:
            main[name if not name.startswith("layers.") else
                 name.split(".", 2)[0] + "." + name.split(".", 2)[1] + "." +
                 _layer_candidates(name.split(".", 2)[2])[-1][0]] = t
    return main, extra


class Step37Weights:
    """The adapter of one config: sources per parameter, published names, export layouts."""

    side_files = (EXTRA_FILE,)
    ignored_suffixes = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        self.config = config
        # a text-only model sets the vision tower aside; a VLM reads it (nothing is hidden then)
        self.kept_prefixes = VISION_PREFIXES if config.vision is None else ()

    def sources(self, name: str) -> list[Source]:
        return [Source(c, s) for c, s in candidates(name, self.config.num_layers)]

    def published(self, name: str) -> str:
        return published_name(name, self.config.num_layers)

    def peft_module(self, name: str) -> str | None:
        """transformers' module path (for PEFT) of our linear weight ``name`` in the model
        transformers builds from this config: ``Step3p7ForConditionalGeneration`` with a vision
        tower (``model.language_model.layers.N...``), else ``Step3p7TextModel`` (``layers.N...``);
        None for an MTP depth's (transformers has no MTP modules)."""
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
        if m is None:
            return None
        rest = m.group(2)
        if rest.startswith("moe.shared_expert."):
            rest = "mlp.shared_experts." + rest[len("moe.shared_expert."):]
        prefix = "model.language_model.layers." if self.config.vision is not None else "layers."
        return f"{prefix}{m.group(1)}.{rest}"

    def export(self, state: dict, src) -> Exported:
        config = self.config
        L = config.num_layers
        published = src is not None and any(".moe.gate_proj.weight" in k or ".share_expert." in k
                                            for k in src.file_of)
        if config.vision is not None:  # the whole VLM, in the published layout
            tensors = {published_name(n, L): t for n, t in state.items()}
            return Exported(tensors, config.to_hf(), "published")
        if not published:
            tensors, extra = _transformers_text_tensors(state, L)
            return Exported(tensors, config.to_hf(), "transformers-text", {EXTRA_FILE: extra} if extra else {})
        tensors = {published_name(n, L): t for n, t in state.items()}
        for k in src.file_of:  # the vision tower and projector, byte for byte
            if k.startswith(VISION_PREFIXES):
                tensors[k] = src.read(k)
        with open(os.path.join(src.path, "config.json")) as f:
            return Exported(tensors, json.load(f), "published")

