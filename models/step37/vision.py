"""Step-3.7's vision tower and projector, from core's ViT blocks (``core/transformer/vit.py``,
``core/transformer/axial_rotary.py``), numerically transformers' ``Step3p7VisionModel`` and
``Step3p7Model.get_image_features``:

    patches (conv, no bias) + learned positions (bilinearly resized to the view's grid)
    -> LayerNorm -> N x ViT layer (2-D RoPE over (column, row), layer scale, quick_gelu)
    -> conv 3x3 stride 2 (C -> 2C) -> conv 3x3 stride 2 (2C -> 4C) -> features [views, n, 4C]
    -> projector (4C -> text hidden)

q and k keep the published checkpoint's channel order (RoPE pairs interleaved, fused ``in_proj``
rows q, k, v), so weights load and export by renaming alone; transformers permutes them into its
rotate-half order on its own load, which gives the same attention.

One micro-batch's images (``core.packed_seq.ImageInputs``): the global views are one batch, the
crops another, both through the tower in one call (each of its FSDP units gathers once per
micro-batch, with images or idle: ``idle_pass``; not at all in a step without images on any
rank of the data-parallel group); each image contributes its crops'
features, then its global view's, in image order, and these replace the token embeddings at
``feature_positions`` (an ``index_copy`` with host-made indices: no device sync). Under context
parallelism every CP rank encodes all its micro-batch's images and keeps the features its shard
holds (``ImageInputs.feature_index``); the tower's gradients are then summed over the CP ranks by
the dense gradient reduction (dp x cp), each rank's loss reaching only the features it wrote.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.packed_seq import ImageInputs
from core.transformer.axial_rotary import AxialRotaryEmbedding, grid_coordinates
from core.transformer.vit import BiasedLinear, LayerNorm, ViTLayer
from models.step37.vision_config import Step37VisionConfig


IDLE_GRID = 5  # patches per side of the idle pass's image (see idle_pass)


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` whose bias starts at zero (``core/init.py`` draws only the kernel)."""

    def constant_init(self) -> dict[str, float]:
        return {"bias": 0.0} if self.bias is not None else {}


class VisionTower(nn.Module):
    """Views ``[[B, C, S, S], ...]`` (one tensor per view size) -> features
    ``[[B, n, 4 * hidden], ...]``."""

    def __init__(self, cfg: Step37VisionConfig):
        super().__init__()
        self.cfg = cfg
        D, grid = cfg.hidden_size, cfg.image_size // cfg.patch_size
        self.patch_embed = nn.Conv2d(cfg.num_channels, D, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.pos_embed = nn.Parameter(torch.empty(grid * grid, D))
        self.pre_norm = LayerNorm(D, eps=cfg.layer_norm_eps)
        self.rotary = AxialRotaryEmbedding(cfg.head_dim, cfg.rope_theta, axes=2)
        self.blocks = nn.ModuleList([
            ViTLayer(D, cfg.num_heads, cfg.intermediate_size, act=cfg.hidden_act, eps=cfg.layer_norm_eps,
                     layer_scale=cfg.layer_scale_init, interleaved_rope=True) for _ in range(cfg.num_layers)])
        self.downsample1 = Conv2d(D, 2 * D, 3, stride=2, padding=1)
        self.downsample2 = Conv2d(2 * D, 4 * D, 3, stride=2, padding=1)

    def positions(self, h: int, w: int) -> torch.Tensor:
        """The learned position table on an ``h x w`` grid (bilinear, as transformers resizes it)."""
        table = self.pos_embed
        g = int(round(table.shape[0] ** 0.5))
        if (h, w) == (g, g):
            return table
        grid = table.reshape(1, g, g, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(h * w, -1)

    def forward(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each entry of ``views`` one size of view ``[B, C, S, S]``, all in one call (one FSDP
        gather per unit and micro-batch, however many view sizes it holds)."""
        xs, ropes, grids = [], [], []
        for pixels in views:
            h, w = pixels.shape[2] // self.cfg.patch_size, pixels.shape[3] // self.cfg.patch_size
            x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
            xs.append(self.pre_norm(x + self.positions(h, w)))
            # cos / sin stay fp32 under bf16 (transformers rotates q and k in fp32 with fp32 angles)
            ropes.append(self.rotary(grid_coordinates(h, w, x.device), torch.float32))
            grids.append((h, w))
        for block in self.blocks:
            xs = block(xs, ropes)
        out = []
        for x, (h, w) in zip(xs, grids):
            x = self.downsample2(self.downsample1(x.transpose(1, 2).reshape(x.shape[0], -1, h, w)))
            out.append(x.flatten(2).transpose(1, 2).contiguous())
        return out


def image_features(tower: VisionTower, projector: nn.Module, images: ImageInputs) -> torch.Tensor:
    """``[F, text hidden]``: per image its crops' projected features, then its global view's."""
    views = [images.pixel_values] + ([images.pixel_values_local] if images.pixel_values_local is not None else [])
    outs = tower(views)
    # one projector call (an FSDP unit of its own: one gather per micro-batch on every rank)
    flat = projector(torch.cat([f.flatten(0, 1) for f in outs]) if len(outs) > 1 else outs[0].flatten(0, 1))
    glob, *local = [part.view(f.shape[0], f.shape[1], -1)
                    for part, f in zip(flat.split([f.shape[0] * f.shape[1] for f in outs]), outs)]
    parts, crop = [], 0
    for i, n in enumerate(images.num_local_patches):  # host ints: slicing only, no device sync
        if n:
            parts.append(local[0][crop:crop + n].flatten(0, 1))
            crop += n
        parts.append(glob[i])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def write_features(x_TH: torch.Tensor, feats: torch.Tensor, images: ImageInputs) -> torch.Tensor:
    """``x_TH`` with rows ``images.feature_positions`` replaced by ``feats`` (counts checked on
    the host), or under context parallelism by the features ``images.feature_index`` selects
    (this shard's placeholders; an ``index_select`` with host-made indices: no device sync)."""
    if feats.shape[0] != images.tower_features:
        raise ValueError(f"the images give {feats.shape[0]} features but the micro-batch has "
                         f"{images.tower_features} image placeholder positions (ImageInputs.feature_positions): "
                         "the placeholder expansion does not match the vision tower's image size")
    if images.feature_index is not None:
        feats = feats.index_select(0, images.feature_index)
    return x_TH.index_copy(0, images.feature_positions, feats.to(x_TH.dtype))


def idle_pass(tower: VisionTower, projector: nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    """``x_TH`` unchanged (an empty ``index_copy``), tied to the tower's and projector's
    parameters through one zero image. A micro-batch without images still runs every
    collective a sharded tower needs (FSDP gathers, reduce-scatters of zero gradients), so data-
    parallel ranks with and without images stay in step. The image is 5 x 5 patches, the
    smallest grid on which every tap of both stride-2 convolutions meets a real input: torch's
    CPU bf16 convolution left the weight gradient of taps that see only padding undefined (NaN,
    now and then, on a one-patch image)."""
    side = IDLE_GRID * tower.cfg.patch_size
    pixels = x_TH.new_zeros(1, tower.cfg.num_channels, side, side, dtype=torch.float32)
    feats = projector(tower([pixels])[0]).flatten(0, 1)[:0]
    return x_TH.index_copy(0, torch.empty(0, dtype=torch.int64, device=x_TH.device), feats.to(x_TH.dtype))
