#!/usr/bin/env python3
"""Storing images beside an image + text dataset: encoded bytes (decoded in the loader) against
preprocessed pixels, in bytes on disk and in loader time per image.

Images are drawn here (no download): a smooth colour field with shapes and mild noise, which
compresses like a photograph more than a flat drawing does, at ``--size`` (default 1024 x 768),
saved as JPEG (quality 90) and PNG. The processor is Step-3.7's with transformers' default
geometry (728 px global view, 504 px crops, longest side 3024), so a 1024 x 768 image is one
global view and 2 x 2 crops.

Per image and format:

* encoded: the file's bytes; loader time = decode (PIL, whole image) + ``pixels`` (resize, crop,
  normalise) from those bytes;
* pixels float32: the global view and crops as the model takes them; loader time = reading them
  back from a file (``np.fromfile``, page cache warm: the best case for this layout);
* pixels uint8: the resized views before normalisation (a quarter of float32; normalising
  remains in the loader).

Timings are the median of ``--repeat`` runs, one thread (``torch.set_num_threads(1)``), as a
loader worker runs.

    python benchmarks/bench_image_storage.py [--size 1024x768] [--repeat 5]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data.images import decode_image  # noqa: E402
from models.registry import image_processor_from_settings  # noqa: E402

TOKEN_IDS = {"<im_patch>": 3, "<patch_start>": 4, "<patch_end>": 5, "<patch_newline>": 6,
             "<im_start>": 7, "<im_end>": 8}


def photo_like(w: int, h: int, seed: int = 0):
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([127 + 100 * np.sin(x / 97 + c) * np.cos(y / 131 - c) for c in (0, 1, 2)], -1)
    img = Image.fromarray(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, w - 50)), int(rng.integers(0, h - 50))
        d.ellipse([x0, y0, x0 + int(rng.integers(30, 300)), y0 + int(rng.integers(30, 300))],
                  fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    return img.filter(ImageFilter.GaussianBlur(1.2))


def encode(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1024x768")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    w, h = (int(v) for v in args.size.split("x"))
    proc = image_processor_from_settings({"image_processor_type": "Step3p7ImageProcessor"}, TOKEN_IDS)
    img = photo_like(w, h)
    print(f"image {w} x {h}: {proc.num_crops(w, h)} crops, {len(proc.placeholder_ids(w, h))} "
          "placeholder tokens")
    print(f"{'storage':<22}{'bytes/image':>14}{'loader ms/image':>18}")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("JPEG", "PNG"):
            data = encode(img, fmt)
            ms = median_ms(lambda: proc.pixels(decode_image(data)), args.repeat)
            print(f"{'encoded ' + fmt:<22}{len(data):>14,}{ms:>18.1f}")
        g, c = proc.pixels(decode_image(encode(img, "PNG")))
        flat = np.concatenate([g.reshape(-1), c.reshape(-1)]).astype(np.float32)
        path = os.path.join(tmp, "pixels.f32")
        flat.tofile(path)
        ms = median_ms(lambda: np.fromfile(path, np.float32), args.repeat)
        print(f"{'pixels float32':<22}{flat.nbytes:>14,}{ms:>18.1f}")
        u8 = flat.size  # one byte per value
        path8 = os.path.join(tmp, "pixels.u8")
        np.zeros(u8, np.uint8).tofile(path8)
        ms = median_ms(lambda: np.fromfile(path8, np.uint8).astype(np.float32), args.repeat)
        print(f"{'pixels uint8':<22}{u8:>14,}{ms:>18.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
