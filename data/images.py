"""Images of image + text chat rows: what the data code asks of an image processor, where an
image's bytes come from, and the check that they decode.

The data code never imports a model family (the layering rule): ``tools/preprocess_data.py`` and
``training/`` build the family's processor (``models.registry.load_image_processor``) and pass
it in. All the data code asks of it is :class:`ImageProcessor`.

Image parts (transformers' chat-template conventions; a part is ``{"type": "image", KEY: ...}``,
or OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}``):

* ``path``: a file, relative to the folder of the input file that holds the row (or absolute);
* ``base64``: the file's bytes, base64-encoded;
* ``image``: a ``data:image/...;base64,...`` URL, or else a path if such a file exists, or else
  base64 bytes (transformers' ``load_image`` order);
* ``url``: a ``data:`` URL only. An ``http(s)://`` URL, under any key, is refused
  (``image_url``): preprocessing never downloads (download the images and give their paths).

A row may instead (Parquet / Arrow / ``save_to_disk``, the ``datasets`` ``Image`` feature) carry an
``images`` column: a list of ``{"bytes", "path"}`` structs, the i-th for the i-th image part of
the conversation (then the parts hold only ``{"type": "image"}``); ``bytes`` wins over
``path``. JSONL rows may do the same with paths (``"images": [{"path": ...}]`` or plain strings).

An image is checked by decoding it whole (:func:`decode_image`): unreadable, truncated, zero-size
or larger than ``max_pixels`` rejects the row with the file (or part) and the reason. EXIF
orientation is applied (as transformers' ``load_image`` does), in preprocessing and in the
loader alike, so the size the placeholder run was made for is the size the pixels have.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from typing import Protocol, runtime_checkable

from data.chat import RowError

DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL's decompression-bomb threshold (~0.25 GB as RGB)
IMAGE_KEYS = ("image", "url", "path", "base64")  # transformers' order of look-up


@runtime_checkable
class ImageProcessor(Protocol):
    """What the data code needs of a model family's image processor."""

    image_token_id: int  # the token written once per image by the chat template, and in each run
    settings: dict       # JSON-able; recorded beside the dataset so training can rebuild it
    token_ids: dict      # special token -> id of the tokens its runs hold (recorded with settings)

    def placeholder_ids(self, width: int, height: int) -> list[int]:
        """The exact token run that replaces one image of this size."""

    def pixels(self, image):
        """(global view float32 [3, S, S], crops float32 [n, 3, P, P]) of a PIL image."""


def _remote(s: str) -> bool:
    return s.lower().startswith(("http://", "https://", "ftp://"))


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()).encode("ascii"), validate=True)  # MIME wraps
    except (binascii.Error, ValueError, UnicodeError) as e:
        raise RowError("image_unreadable", f"{where}: not valid base64 ({e})") from None


def _data_url(url: str, where: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.lower().startswith("data:image/") or ";base64" not in head.lower():
        raise RowError("image_unreadable", f"{where}: a data URL must read "
                                           "'data:image/<kind>;base64,<bytes>'")
    return _b64(body, where)


def part_source(part: dict, where: str) -> tuple[str, object]:
    """``("bytes", b)`` or ``("path", p)`` for one image part; ``("column", None)`` for a part
    that names no source (its image is in the row's ``images`` list)."""
    if part.get("type") == "image_url":
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, dict) else inner
        part = {"type": "image", "url": url}
    key = next((k for k in IMAGE_KEYS if part.get(k) is not None), None)
    if key is None:
        return "column", None
    value = part[key]
    if not isinstance(value, str):
        raise RowError("wrong_type", f"{where}: {key!r} must be a string, got {type(value).__name__}")
    if _remote(value):
        raise RowError("image_url", f"{where}: {value[:80]!r} is a remote URL; preprocessing runs "
                                    "offline and never downloads: download the image and give its "
                                    "path ({\"type\": \"image\", \"path\": ...})")
    if value.startswith("data:"):
        return "bytes", _data_url(value, where)
    if key == "url":
        raise RowError("image_url", f"{where}: 'url' takes a data: URL only (got {value[:80]!r}); "
                                    "give a local file as 'path'")
    if key == "base64":
        return "bytes", _b64(value, where)
    if key == "image" and not os.path.exists(value) and len(value) > 256:
        return "bytes", _b64(value, where)  # transformers' load_image: not a file, so base64
    return "path", value


def column_source(item, where: str) -> tuple[str, object]:
    """The source of one entry of a row's ``images`` list (``{"bytes", "path"}`` or a path)."""
    if isinstance(item, str):
        item = {"path": item}
    if not isinstance(item, dict):
        raise RowError("wrong_type", f"{where}: expected {{'bytes', 'path'}} or a path, got "
                                     f"{type(item).__name__}")
    if item.get("bytes") is not None:
        data = item["bytes"]
        if isinstance(data, str):  # bytes written to JSON
            return "bytes", _b64(data, where)
        return "bytes", bytes(data)
    if isinstance(item.get("path"), str):
        if _remote(item["path"]):
            raise RowError("image_url", f"{where}: {item['path'][:80]!r} is a remote URL; "
                                        "preprocessing never downloads: give a local path")
        return "path", item["path"]
    raise RowError("image_unreadable", f"{where}: neither bytes nor a path")


def read_source(kind: str, value, base_dir: str, where: str) -> tuple[bytes, str]:
    """(the image's bytes, how to name it in an error)."""
    if kind == "bytes":
        return value, f"{where} (inline bytes)"
    path = value if os.path.isabs(value) else os.path.join(base_dir, value)
    try:
        with open(path, "rb") as f:
            return f.read(), f"{where} {path}"
    except OSError as e:
        raise RowError("image_unreadable", f"{where}: cannot read {path} ({e.strerror or e})") \
            from None


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, name: str = "image"):
    """The whole decoded image (PIL, EXIF orientation applied). ``RowError``: ``image_empty``
    (no bytes, or a zero width or height), ``image_too_large`` (more than ``max_pixels``, checked
    on the header before any pixel is decoded), ``image_unreadable`` (not an image, truncated,
    corrupt)."""
    from PIL import Image, ImageOps

    if not data:
        raise RowError("image_empty", f"{name}: zero bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                raise RowError("image_too_large", f"{name}: {w} x {h} = {w * h:,} pixels, more than "
                                                  f"--max-image-pixels {max_pixels:,}")
            if w == 0 or h == 0:
                raise RowError("image_empty", f"{name}: {w} x {h} pixels")
            img.load()  # decodes every byte: a truncated or corrupt file fails here
            return ImageOps.exif_transpose(img)
    except RowError:
        raise
    except Image.DecompressionBombError as e:
        raise RowError("image_too_large", f"{name}: {e}") from None
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError, struct.error...
        raise RowError("image_unreadable", f"{name}: {type(e).__name__}: {e}") from None
