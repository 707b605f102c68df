"""Step-3.7's image preprocessing without torchvision: the crop plan, the pixels and the
placeholder tokens of one image, equal to transformers' ``Step3p7ImageProcessor`` (a torchvision
backend) and ``Step3p7Processor`` (proved on committed fixtures: tests/unit/test_image_processing.py).

Why our own: transformers' image processor needs torchvision, which is not installed where we train
(no build matches our CPU torch). The numerics are torchvision's, reproduced with the same torch
calls: images become uint8 tensors (PIL's RGB conversion, transparency composited on white), every
resize is ``torch.nn.functional.interpolate(..., "bilinear", antialias=True)`` taken the way
torchvision takes it (native uint8 when the CPU dispatch is AVX2 / AVX512 or on ARM, else float32
rounded back to uint8: see :func:`resize_uint8`), and the rescale by 1/255 is fused into the normalisation.

What one image becomes:

- a global view: the image (zero-padded to a square at the bottom/right first when it is
  degenerate: shortest side under 32 px and aspect over 4) resized to the planned (w, h), then to
  ``image_size`` x ``image_size`` (728);
- zero or more crops: the image resized to a grid of ``window`` x ``window`` tiles (the window
  adapts to the aspect ratio, see :meth:`Step37ImageProcessor.plan`), cut row by row, each tile
  resized to ``patch_size`` x ``patch_size`` (504);
- its tokens: per crop ``<patch_start> <im_patch> * per_crop <patch_end>`` and ``<patch_newline>``
  after the last crop of every row but the last, then ``<im_start> <im_patch> * per_global
  <im_end>``; ``per_crop = (patch_size // 56) ** 2`` (81) and ``per_global = (image_size // 56) ** 2``
  (169), 56 being the ViT patch (14) times the vision tower's downsampling (4).

The API (a dataset stores ``settings`` and ``token_ids`` beside itself, as JSON, so that its loader
rebuilds the processor without the tokenizer folder)::

    proc = Step37ImageProcessor.from_pretrained(folder, token_id)   # token_id: str -> int
    proc.settings        # dict, JSON-able: the preprocessing numbers and "image_processor_type"
    proc.token_ids       # dict, JSON-able: {"<im_patch>": id, "<patch_start>": id, ...}
    proc = Step37ImageProcessor.from_settings(proc.settings, proc.token_ids)   # the same processor
    proc.plan(width, height) -> CropPlan
    proc.placeholder_ids(width, height) -> list[int]
    proc.expand_ids(ids, sizes) -> list[int]     # each <im_patch> of a rendered chat expanded
    proc.num_placeholders(width, height) -> int  # len(placeholder_ids(...)), without the list
    proc.pixels(pil_image) -> (global float32 [3, S, S], crops float32 [n, 3, P, P])

Checked equal (bit for bit on the native path) under torch's AVX512, AVX2 and DEFAULT CPU
dispatch (``ATEN_CPU_CAPABILITY``); ARM's kernels are not checked.

``models.registry.load_image_processor(folder, token_id)`` and
``models.registry.image_processor_from_settings(settings, token_ids)`` pick the family by
``image_processor_type``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from models.common.processor_files import read_image_processor_config

# transformers' class defaults (Step3p7ImageProcessor and its base classes), used for missing keys.
DEFAULTS = {
    "image_size": 728,          # size["height"]: the global view's side
    "patch_size": 504,          # a crop's side after its resize
    "max_image_size": 3024,     # longest side the crop plan works with (larger is scaled down)
    "vision_patch_size": 14,    # ViT patch
    "downsampler_stride": 4,    # the vision tower's two stride-2 downsamplers
    "image_mean": [0.48145466, 0.4578275, 0.40821073],   # OpenAI CLIP
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
}
TYPE_NAMES = ("Step3p7ImageProcessor", "Step3p7ImageProcessorFast")
TOKENS = ("<im_patch>", "<patch_start>", "<patch_end>", "<patch_newline>", "<im_start>", "<im_end>")
BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, the only resample transformers' class uses


@dataclass(frozen=True)
class CropPlan:
    """How one image is cut (transformers' ``_plan_patches``, sizes as (width, height))."""

    global_size: tuple[int, int]   # the global view's first resize, before it is squared
    crop_size: tuple[int, int]     # the image's resize before it is cut into windows
    window: int                    # tile side; 0: no crops
    grid: tuple[int, int]          # (columns, rows); (0, 0) without crops
    square_pad: bool               # zero-pad to a square first (degenerate aspect)

    @property
    def num_crops(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def newlines(self) -> tuple[bool, ...]:
        """Per crop, row-major: a ``<patch_newline>`` follows it (last column, not last row)."""
        cols, rows = self.grid
        return tuple(c == cols - 1 and r < rows - 1 for r in range(rows) for c in range(cols))


def settings_from_config(raw: dict, where: str) -> dict:
    """Our settings from a transformers image processor dict (missing or null keys: transformers'
    defaults); what we cannot reproduce is an error naming ``where``."""
    kind = raw.get("image_processor_type")
    if kind is not None and kind not in TYPE_NAMES:
        raise ValueError(f"{where}: image_processor_type {kind!r} is not Step-3.7's "
                         f"({' or '.join(TYPE_NAMES)})")
    out = {k: v for k, v in DEFAULTS.items()}
    for key in DEFAULTS:
        if key != "image_size" and raw.get(key) is not None:
            out[key] = raw[key]
    size = raw.get("size")
    if size is not None:
        if isinstance(size, int):
            out["image_size"] = size
        elif isinstance(size, dict) and isinstance(size.get("height"), int):
            out["image_size"] = size["height"]  # transformers squares the global view to the height
        else:
            raise ValueError(f"{where}: size {size!r}: expected an int or {{'height', 'width'}}")
    resample = raw.get("resample")
    if resample is not None and resample != BILINEAR:
        raise ValueError(f"{where}: resample {resample!r}: only bilinear ({BILINEAR}) is implemented")
    return _checked(out, where)


def _checked(settings: dict, where: str) -> dict:
    unknown = set(settings) - set(DEFAULTS) - {"image_processor_type"}
    if unknown:
        raise ValueError(f"{where}: unknown image processor settings {sorted(unknown)}")
    out = dict(DEFAULTS, **{k: v for k, v in settings.items() if k in DEFAULTS})
    for key in ("image_size", "patch_size", "max_image_size", "vision_patch_size", "downsampler_stride"):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] <= 0:
            raise ValueError(f"{where}: {key} must be a positive int, got {out[key]!r}")
    for key in ("image_mean", "image_std"):
        value = out[key]
        if isinstance(value, (int, float)):
            value = [float(value)] * 3
        if len(value) != 3 or (key == "image_std" and any(v == 0 for v in value)):
            raise ValueError(f"{where}: {key} must be 3 numbers (std non-zero), got {out[key]!r}")
        out[key] = [float(v) for v in value]
    out["image_processor_type"] = TYPE_NAMES[0]
    return out


class Step37ImageProcessor:
    """One image's crop plan, pixels and placeholder token ids (see the module docstring)."""

    TYPE_NAMES = TYPE_NAMES  # the image_processor_type values this class reads (registry lookup)

    def __init__(self, settings: dict, token_ids: dict):
        self.settings = _checked(settings, "image processor settings")
        missing = [t for t in TOKENS if not isinstance(token_ids.get(t), int)]
        if missing:
            raise ValueError(f"image processor token ids: missing {missing}")
        self.token_ids = {t: int(token_ids[t]) for t in TOKENS}
        s = self.settings
        self.image_size, self.patch_size = s["image_size"], s["patch_size"]
        stride = s["vision_patch_size"] * s["downsampler_stride"]
        self.global_tokens = (self.image_size // stride) ** 2
        self.crop_tokens = (self.patch_size // stride) ** 2
        ids = self.token_ids
        self.image_token_id = ids["<im_patch>"]
        self.patch_start_id, self.patch_end_id = ids["<patch_start>"], ids["<patch_end>"]
        self.patch_newline_id = ids["<patch_newline>"]
        self.im_start_id, self.im_end_id = ids["<im_start>"], ids["<im_end>"]
        self._mean, self._std = _fused_mean_std(s)

    @classmethod
    def from_pretrained(cls, folder: str, token_id: Callable[[str], int]) -> "Step37ImageProcessor":
        """From a processor folder (its image processor config) and the tokenizer's token -> id;
        a special token the tokenizer lacks is an error naming it."""
        raw, where = read_image_processor_config(folder)
        settings = settings_from_config(raw, where)
        ids = {}
        for token in TOKENS:
            try:
                value = token_id(token)
            except (KeyError, ValueError) as e:
                raise ValueError(f"{folder}: the tokenizer has no {token!r} ({e})") from None
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{folder}: the tokenizer has no {token!r} (got id {value!r})")
            ids[token] = value
        if len(set(ids.values())) != len(ids):  # e.g. convert_tokens_to_ids giving unk for each
            raise ValueError(f"{folder}: the image tokens share ids {ids}: the tokenizer lacks some")
        return cls(settings, ids)

    @classmethod
    def from_settings(cls, settings: dict, token_ids: dict) -> "Step37ImageProcessor":
        return cls(settings, token_ids)

    # -- the plan and the tokens ---------------------------------------------------------------
    def plan(self, width: int, height: int) -> CropPlan:
        """transformers' sliding-window plan: degenerate images are squared, images over
        ``max_image_size`` scaled down (int truncation); an image that fits the global view gets
        crops only when elongated (aspect > 1.5, window = its short side); a larger one gets
        ``patch_size`` windows, or ``min(short side, patch_size)`` when the aspect exceeds 4; each
        side snaps to a multiple of the window (up when the remainder exceeds 20% of it)."""
        if width <= 0 or height <= 0:
            raise ValueError(f"image size {width}x{height}: both sides must be positive")
        square_pad = min(width, height) < 32 and max(width / height, height / width) > 4
        if square_pad:
            width = height = max(width, height)
        limit = self.settings["max_image_size"]
        if max(width, height) > limit:
            scale = limit / max(width, height)
            width, height = int(width * scale), int(height * scale)
            if min(width, height) == 0:
                raise ValueError(f"image size: a side scales to 0 px under max_image_size {limit}")
        short, long = min(width, height), max(width, height)
        if long <= self.image_size:
            window = short if long / short > 1.5 else 0
        elif long / short > 4:
            window = min(short, self.patch_size)
        else:
            window = self.patch_size
        if window == 0:
            return CropPlan((width, height), (width, height), 0, (0, 0), square_pad)

        def snap(dim: int) -> int:
            if dim < window:
                return dim
            return window * (dim // window + (dim % window > 0.2 * window))

        crop_w, crop_h = snap(width), snap(height)
        grid = (max(1, crop_w // window), max(1, crop_h // window))
        return CropPlan((width, height), (crop_w, crop_h), window, grid, square_pad)

    def num_crops(self, width: int, height: int) -> int:
        return self.plan(width, height).num_crops

    def placeholder_ids(self, width: int, height: int) -> list[int]:
        """The token ids ``Step3p7Processor`` puts in place of one ``<im_patch>`` in the text."""
        crop = [self.patch_start_id] + [self.image_token_id] * self.crop_tokens + [self.patch_end_id]
        ids: list[int] = []
        for newline in self.plan(width, height).newlines:
            ids += crop
            if newline:
                ids.append(self.patch_newline_id)
        return ids + [self.im_start_id] + [self.image_token_id] * self.global_tokens + [self.im_end_id]

    def expand_ids(self, ids, sizes) -> list[int]:
        """``ids`` (a rendered chat, one ``<im_patch>`` per image part) with each ``<im_patch>``
        replaced by :meth:`placeholder_ids` of the image of that (width, height), in order: what
        ``Step3p7Processor`` does to the text."""
        ids = [int(i) for i in ids]
        found = ids.count(self.image_token_id)
        if found != len(sizes):
            raise ValueError(f"the text holds {found} <im_patch> token(s) but {len(sizes)} image(s) "
                             "came with it")
        out: list[int] = []
        images = iter(sizes)
        for i in ids:
            out.extend(self.placeholder_ids(*next(images)) if i == self.image_token_id else (i,))
        return out

    def num_placeholders(self, width: int, height: int) -> int:
        p = self.plan(width, height)
        return p.num_crops * (self.crop_tokens + 2) + sum(p.newlines) + self.global_tokens + 2

    # -- the pixels ----------------------------------------------------------------------------
    def pixels(self, image) -> tuple[np.ndarray, np.ndarray]:
        """(global view float32 [3, S, S], crops float32 [n, 3, P, P]) of a PIL image."""
        x = to_uint8_chw(image, self.settings["do_convert_rgb"])
        _, height, width = x.shape
        p = self.plan(width, height)
        if p.square_pad:
            side = max(width, height)
            x = F.pad(x, (0, side - width, 0, side - height))
        x = x[None]
        (gw, gh), s = p.global_size, self.image_size
        glob = resize_uint8(resize_uint8(x, gh, gw), s, s)
        if p.window == 0:
            crops = torch.empty((0, 3, self.patch_size, self.patch_size), dtype=torch.uint8)
        else:
            cw, ch = p.crop_size
            big = resize_uint8(x, ch, cw)[0]
            w = p.window
            tiles = [big[:, r:r + w, c:c + w] for r in range(0, ch, w) for c in range(0, cw, w)]
            crops = resize_uint8(torch.stack(tiles), self.patch_size, self.patch_size)
        return self._normalize(glob)[0].numpy(), self._normalize(crops).numpy()

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        s = self.settings
        if s["do_normalize"]:
            return x.to(torch.float32).sub_(self._mean).div_(self._std)
        if s["do_rescale"]:
            return x * s["rescale_factor"]
        return x.to(torch.float32)


def _fused_mean_std(s: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std as transformers fuses them with the rescale: float32, times 1/rescale."""
    mean, std = torch.tensor(s["image_mean"]), torch.tensor(s["image_std"])
    if s["do_rescale"] and s["do_normalize"]:
        mean, std = mean * (1.0 / s["rescale_factor"]), std * (1.0 / s["rescale_factor"])
    return mean.view(-1, 1, 1), std.view(-1, 1, 1)


def to_uint8_chw(image, convert_rgb: bool = True) -> torch.Tensor:
    """A PIL image as uint8 [C, H, W], RGB the way transformers converts it: an image with an
    alpha band or a transparency entry is composited onto opaque white, anything else
    ``convert("RGB")``."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(image).__name__}")
    if convert_rgb:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            image = image.convert("RGB")
    arr = np.array(image)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.dtype != np.uint8 or arr.shape[2] != 3:
        raise ValueError(f"image mode {image.mode!r}: expected 8-bit RGB after conversion")
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


def native_uint8_resize() -> bool:
    """torchvision (0.29) resizes uint8 bilinearly in uint8 where torch's CPU dispatch is AVX2 or
    AVX512, or on ARM (its ``_do_native_uint8_resize_on_cpu``); elsewhere through float32,
    rounded back to uint8."""
    import platform

    return (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
            or platform.machine() in ("aarch64", "arm64"))


def resize_uint8(x: torch.Tensor, height: int, width: int, native: bool | None = None) -> torch.Tensor:
    """Bilinear antialiased resize of uint8 [N, C, H, W], as torchvision's ``resize`` does it."""
    if tuple(x.shape[-2:]) == (height, width):
        return x
    native = native_uint8_resize() if native is None else native
    if native:
        return F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    out = F.interpolate(x.to(torch.float32), size=(height, width), mode="bilinear",
                        align_corners=False, antialias=True)
    return out.round_().to(torch.uint8)
