"""The image encoder in the planner: a vision-language model's tower, downsamplers and projector
(``core.costs.shapes.VisionShape``) run on the first pipeline stage only, so their FLOPs, parameters
(with their gradients and optimizer state) and activations all land on stage 0, and the default
pipeline layout moves decoder layers off stage 0 to pay for them.

How many images a pack holds comes from the planner's inputs, not from data:
``image_token_share`` (F) is the fraction of a pack's tokens that are image features (the
``<im_patch>`` placeholders the projector's outputs replace; the few delimiter tokens around a
view count as text), and ``image_crops_per_image`` (C) the average local crops per image, each
image a global view plus C crops. One image then yields ``f = f_global + C f_crop`` features and
costs ``V = V_global + C V_crop`` forward FLOPs; a micro-batch of T tokens holds ``F T / f``
images, so stage 0 runs ``F x V / f`` more forward FLOPs per token. Under context parallelism
every CP rank encodes all its pack's images (``data/cp_shard.py``: duplicated work, no
communication), so its encoder FLOPs and activations are the whole pack's ``T`` tokens' worth,
not its shard's ``T / cp``; MFU counts them once per pack. With F = 0 (the default)
nothing here changes a plan: text-only plans are those of a text model.

What learns: everything, or (``freeze_vision``) the projector only, or under LoRA nothing of it
(no adapters on the tower; frozen like the base). A frozen tower runs its forward only (nothing
before the projector needs a gradient) and keeps no activations; a trained projector behind it
costs its weight gradient (one forward's FLOPs) and keeps its input. Recompute: the tower's blocks
follow ``--recompute-granularity`` (all of them; ``--recompute-num-layers`` counts decoder layers
only), rerunning their forward in the backward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from core.costs.activations import vision_view_bytes, vit_layer_bytes
from core.cli import option
from core.costs.flops import balanced_layout, vision_view_flops
from core.model_api import ParamSpec
from models.registry import shapes_of
from training.planner.shares import TensorShare, rank_shares

VISION_BLOCK = -1000  # the tower's block k is VISION_BLOCK - k (below every extra block's -1 - k)


@dataclass
class ImageMix:
    """Images in the packs, for the planner (tools/plan_memory.py)."""

    image_token_share: float = option(0.0, "fraction of each pack's tokens that are image features (the "
                                           "placeholders the vision tower's projected outputs replace; 0: "
                                           "text only). The tower runs on the first pipeline stage: its "
                                           "FLOPs, weights and activations are booked there, and the default "
                                           "pipeline layout moves layers off that stage to pay for them")
    image_crops_per_image: float = option(0.0, "average local crops per image beside its global view (the "
                                               "image processor's tiling: 0 for images that fit the global "
                                               "view, 4 for about 1024 x 1024, 36 for 3024 x 3024)")
    freeze_vision: bool = option(False, "plan the vision tower frozen (the projector still learns): its "
                                        "forward only, no gradients, optimizer state or activations")

    def __post_init__(self):
        if not 0 <= self.image_token_share < 1:
            raise ValueError(f"--image-token-share must be in [0, 1), got {self.image_token_share}")
        if not self.image_crops_per_image >= 0:
            raise ValueError(f"--image-crops-per-image must be >= 0, got {self.image_crops_per_image}")


def add_image_flags(parser) -> None:
    """``ImageMix``'s flags in a group of their own; a flag the parser already has (a training
    flag of the same name, e.g. ``--freeze-vision``) is left to it (same destination)."""
    import argparse
    import dataclasses

    group = parser.add_argument_group("images", ImageMix.__doc__)
    for f in dataclasses.fields(ImageMix):
        flag = "--" + f.name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        kw = dict(action=argparse.BooleanOptionalAction) if f.type in (bool, "bool") else dict(type=float)
        group.add_argument(flag, dest=f.name, default=f.default, help=f.metadata["help"] + (
            "" if f.type in (bool, "bool") else f" (default: {f.default:g})"), **kw)


def image_mix(ns) -> ImageMix:
    """The parsed flags' ``ImageMix`` (``ValueError`` naming the flag)."""
    return ImageMix(**{k: getattr(ns, k) for k in ("image_token_share", "image_crops_per_image", "freeze_vision")})


def has_images(inp) -> bool:
    return inp.image_token_share > 0


def trained_part(inp) -> str:
    """What of the encoder learns: ``all``, ``projector`` (--freeze-vision) or ``none`` (LoRA)."""
    return "none" if inp.lora_rank else "projector" if inp.freeze_vision else "all"


def _views(v, inp) -> list:
    """(size, views per image) of one image: its global view and its average crops."""
    views = [(v.image_size, 1.0)]
    if inp.image_crops_per_image:
        if not v.crop_size:
            raise ValueError("--image-crops-per-image: this model's vision tower takes no crops")
        views.append((v.crop_size, inp.image_crops_per_image))
    return views


def features_per_image(v, inp) -> float:
    return sum(n * v.features(size) for size, n in _views(v, inp))


def images_per_token(v, inp) -> float:
    """Images per token of a pack: ``F / f``."""
    return inp.image_token_share / features_per_image(v, inp)


@dataclass(frozen=True)
class VisionFlops:
    """Per token of a pack (averaged over its image and text tokens): the encoder's forward FLOPs,
    its backward's, and what recompute reruns."""

    forward: float = 0.0
    backward: float = 0.0
    redo: float = 0.0

    @property
    def useful(self) -> float:
        """Counted in MFU: the forward and the backward, no recompute."""
        return self.forward + self.backward


def vision_flops(cfg, inp) -> VisionFlops:
    """``VisionFlops`` of the stage-0 chunk: the encoder's per image times ``F / f`` images per
    token. Trained: backward twice the forward, recompute reruns the blocks; projector only: its
    weight gradient (one projector forward); LoRA: no backward."""
    v = shapes_of(cfg).vision
    if not has_images(inp) or v is None:
        return VisionFlops()
    per_image = {"embedding": 0.0, "layers": 0.0, "downsamplers": 0.0, "projector": 0.0}
    for size, n in _views(v, inp):
        for k, x in vision_view_flops(v, size).items():
            per_image[k] += n * x
    k = images_per_token(v, inp)
    fwd = k * sum(per_image.values())
    part = trained_part(inp)
    if part == "none":
        return VisionFlops(fwd)
    if part == "projector":
        return VisionFlops(fwd, k * per_image["projector"])
    return VisionFlops(fwd, 2 * fwd, k * per_image["layers"] if inp.recompute_placement.on else 0.0)


def vision_bytes(cfg, inp) -> int:
    """Bytes the encoder keeps for one micro-batch on a stage-0 rank (the whole pack's ``F T / f``
    images, on every CP rank; an expected count: a pack's images vary)."""
    v = shapes_of(cfg).vision
    if not has_images(inp) or v is None:
        return 0
    granularity = inp.recompute_placement.granularity
    per_image = sum(n * vision_view_bytes(v, size, inp.act_bytes, granularity, trained_part(inp))
                    for size, n in _views(v, inp))
    return round(images_per_token(v, inp) * inp.tokens * per_image)  # every CP rank: the whole pack's


def vision_working_set(cfg, inp) -> int:
    """What one recomputed ViT block holds again in its backward, for the micro-batch's views
    (they run as one batch): its whole activations less what recompute kept."""
    v = shapes_of(cfg).vision
    rc = inp.recompute_placement
    if not has_images(inp) or v is None or not rc.on or trained_part(inp) != "all":
        return 0
    b, k = inp.act_bytes, images_per_token(v, inp) * inp.tokens
    return round(k * sum(n * (vit_layer_bytes(v, v.patches(size), b) - vit_layer_bytes(v, v.patches(size), b,
                                                                                          rc.granularity))
                         for size, n in _views(v, inp)))


def layout_for(cfg, inp) -> str | None:
    """The pipeline layout to plan: ``--pipeline-layout`` when given; with images and several
    stages, the split that minimises the slowest stage with the encoder's useful FLOPs per token
    (in forward units: ``(forward + backward) / 3``, as a decoder layer's step is three forwards)
    on stage 0; else None (the trainer's default)."""
    if inp.pipeline_layout or not has_images(inp) or inp.pp * inp.vpp == 1:
        return inp.pipeline_layout
    extra = vision_flops(cfg, inp).useful / 3
    key = (type(cfg).__name__, repr(cfg), inp.pp * inp.vpp, inp.seq_length, extra)
    if key not in _LAYOUTS:  # the search asks for every memory mode of a (pp, vpp)
        counts = balanced_layout(shapes_of(cfg), inp.pp * inp.vpp, inp.seq_length, first_extra=extra)
        _LAYOUTS[key] = ",".join(map(str, counts))
    return _LAYOUTS[key]


_LAYOUTS: dict = {}


_WITH_VISION: dict = {}


def planned_shares(cfg, inp) -> list:
    """``rank_shares`` for these inputs: the layout from ``layout_for``, and with images the
    stage-0 chunk carries the encoder's weights (meta tensors from ``VisionShape.parameters``;
    frozen as ``trained_part`` says; each ViT block a block of its own, ``VISION_BLOCK - k``)."""
    layout = layout_for(cfg, inp)
    shares = rank_shares(cfg, inp.pp, inp.vpp, inp.ep, layout, inp.seq_length, inp.lora)
    v = shapes_of(cfg).vision
    built = getattr(cfg, "vision", None) is not None  # the model holds its tower (left out of the shares)
    if v is None or not (has_images(inp) or built):
        return shares
    part = trained_part(inp)
    key = (id(shares), part)
    if key not in _WITH_VISION:
        tensors = []
        for name, shape, layer, role in v.parameters():
            frozen = part == "none" or (part == "projector" and not name.startswith("projector"))
            tensors.append(TensorShare(torch.empty(shape, device="meta"), ParamSpec(role=role),
                                       None if layer is None else VISION_BLOCK - layer, frozen=frozen))
        first = shares[0][0]
        first = replace(first, tensors=first.tensors + tuple(tensors))
        _WITH_VISION[key] = (shares, [[first, *shares[0][1:]], *shares[1:]])
    return _WITH_VISION[key][1]

