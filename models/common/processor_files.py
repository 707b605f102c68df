"""Where a Hugging Face processor folder keeps its image processor's settings (any family)."""
from __future__ import annotations

import json
import os

IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"


def read_image_processor_config(folder: str) -> tuple[dict, str]:
    """The image processor's dict of a processor folder, and the file it came from: the
    ``image_processor`` entry of processor_config.json wins (what transformers >= 5 saves), else
    preprocessor_config.json (transformers' own order)."""
    nested = os.path.join(folder, PROCESSOR_FILE)
    if os.path.isfile(nested):
        raw = _read_json(nested)
        if isinstance(raw.get("image_processor"), dict):
            return raw["image_processor"], f"{nested} (image_processor)"
    path = os.path.join(folder, IMAGE_PROCESSOR_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no image processor config: neither {IMAGE_PROCESSOR_FILE} "
                                f"nor an 'image_processor' entry in {PROCESSOR_FILE}")
    return _read_json(path), path


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw
