"""data.images.decode_image as documented (docs/vlm.md): a header with a zero height is
``image_empty``, ``max_pixels`` above PIL's decompression-bomb limit decodes (PIL's limit raised
for the decode and restored after), and the pixels are transformers' ``load_image``'s (EXIF
orientation, then ``convert("RGB")``: an alpha band is dropped, not composited on white)."""
from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from data.chat import RowError
from data.images import decode_image


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def test_a_zero_height_png_is_image_empty():
    data = bytearray(_png(Image.new("RGB", (5, 1))))
    data[20:24] = (0).to_bytes(4, "big")  # IHDR height, then the chunk's CRC made right again
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    with pytest.raises(RowError) as e:
        decode_image(bytes(data), name="flat.png")
    assert e.value.reason == "image_empty" and e.value.detail == "flat.png: 5 x 0 pixels"


def test_max_pixels_above_pils_bomb_limit_decodes(monkeypatch):
    """PIL refuses more than twice Image.MAX_IMAGE_PIXELS at open; a smaller limit stands in for
    PIL's 89M here, so the test decodes 10,000 pixels rather than 200M."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    data = _png(Image.new("RGB", (100, 100), (1, 2, 3)))
    assert decode_image(data, max_pixels=20_000).size == (100, 100)
    assert Image.MAX_IMAGE_PIXELS == 1000  # PIL's setting is as it was
    with pytest.raises(RowError, match="more than --max-image-pixels 5,000"):
        decode_image(data, max_pixels=5_000)


def test_transparency_is_dropped_as_transformers_load_image_drops_it():
    from transformers.image_utils import load_image

    rgba = np.zeros((6, 8, 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, np.arange(8, dtype=np.uint8) * 30  # red under varying alpha
    for img in (Image.fromarray(rgba, "RGBA"), Image.fromarray(rgba[..., [0, 3]], "LA")):
        data = _png(img)
        ours = decode_image(data)
        want = load_image(Image.open(io.BytesIO(data)))
        assert ours.mode == "RGB" and np.array_equal(np.asarray(ours), np.asarray(want))
