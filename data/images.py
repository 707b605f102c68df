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
or larger than ``max_pixels`` rejects the row with the file (or part) and the reason. What
transformers' ``load_image`` does to a file is done here, in preprocessing and in the loader
alike: EXIF orientation is applied (so the size the placeholder run was made for is the size the
pixels have), then ``convert("RGB")``, which drops an alpha band (transparent pixels keep the
colour stored under them; only a PIL image handed to the processor itself is composited on white).
``max_pixels`` above PIL's decompression-bomb limit raises that limit for the decode (PIL would
refuse the image otherwise).

Each image's bytes are stored with their CRC-32 (:func:`checksum`), which the loader checks
before decoding them (``data/image_store.py``): a damaged images file is refused, never decoded
into other pixels.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
import zlib
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

from data.chat import RowError

DEFAULT_MAX_IMAGE_PIXELS = 89_478_485  # PIL's decompression-bomb threshold (~0.25 GB as RGB)
IMAGE_KEYS = ("image", "url", "path", "base64")  # transformers' order of look-up
INDEX_COLUMNS = 5  # per image in PREFIX_image_index_document: run start, run length, width,
#                    height, CRC-32 of its bytes (data/image_store.py)


def checksum(data: bytes) -> int:
    """The CRC-32 of an image's bytes (zlib's, unsigned): ~1.7 GB/s on one core, so checking
    an image the loader reads anyway costs well under 1% of decoding it."""
    return zlib.crc32(data) & 0xFFFFFFFF


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
    """The whole decoded image (PIL, EXIF orientation applied, RGB: what transformers'
    ``load_image`` gives). ``RowError``: ``image_empty`` (no bytes, or a zero width or height),
    ``image_too_large`` (more than ``max_pixels``, checked on the header before any pixel is
    decoded), ``image_unreadable`` (not an image, truncated, corrupt)."""
    from PIL import Image, ImageOps

    if not data:
        raise RowError("image_empty", f"{name}: zero bytes")
    try:
        with warnings.catch_warnings(), _bomb_limit(Image, max_pixels):
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                raise RowError("image_too_large", f"{name}: {w} x {h} = {w * h:,} pixels, more than "
                                                  f"--max-image-pixels {max_pixels:,}")
            if w == 0 or h == 0:
                raise RowError("image_empty", f"{name}: {w} x {h} pixels")
            img.load()  # decodes every byte: a truncated or corrupt file fails here
            img = ImageOps.exif_transpose(img)
            return img if img.mode == "RGB" else img.convert("RGB")
    except RowError:
        raise
    except Image.DecompressionBombError as e:
        raise RowError("image_too_large", f"{name}: {e}") from None
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError, struct.error...
        size = _declared_size(data)
        if size is not None and 0 in size:  # PIL refuses such a header before we see the size
            raise RowError("image_empty", f"{name}: {size[0]} x {size[1]} pixels") from None
        raise RowError("image_unreadable", f"{name}: {type(e).__name__}: {e}") from None


@contextmanager
def _bomb_limit(image_module, max_pixels: int):
    """PIL refuses at open an image of more than twice ``Image.MAX_IMAGE_PIXELS`` pixels (a
    decompression bomb): while decoding, the limit is at least ``max_pixels`` (which we check on
    the header ourselves), and PIL's own setting is restored after."""
    before = image_module.MAX_IMAGE_PIXELS
    if before is not None and max_pixels > before:
        image_module.MAX_IMAGE_PIXELS = max_pixels
    try:
        yield
    finally:
        image_module.MAX_IMAGE_PIXELS = before


def _declared_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) that a PNG or GIF header declares, or None (another format, too short)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
    return None
