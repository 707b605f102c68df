"""Datasets published together, and the check that training reads them together.

A chat run of ``tools/preprocess_data.py`` writes two datasets that only make sense as a pair:
``PREFIX_text_document`` and ``PREFIX_loss_mask_document``. Training finds the mask by its name
beside the text, so a text published without its mask (a full disk between the two renames)
would put the loss on every token, user turns included, and a mask left by an earlier run at the
same prefix would be paired with the new text. Neither may pass silently.

Every dataset a run publishes carries the same ``unit`` in its sidecar (``PREFIX.meta.json``,
``data/dataset_stats.py``): a random id shared by the run's datasets and the keys it wrote
(``["text", "loss_mask"]`` for chat). :func:`check_pair` refuses a text whose unit names a loss
mask that is missing, and a mask whose unit is not the text's. Datasets without units (written
by Megatron-LM or an older version of the tool) pair by name as before.

A unit is read from a sidecar whose sizes match the files even when the modification times do
not (``dataset_stats.recorded_facts``): a copy made with plain ``cp`` is still one unit. Sizes and
times say nothing of the bytes; what can rot silently carries its own checksums (an image run's
images, ``data/image_store.py``).
"""
from __future__ import annotations

import os
import uuid

from data.dataset_stats import recorded_facts
from data.indexed_dataset import DatasetError, IndexedDataset


def new_unit(keys: list[str]) -> dict:
    """The ``unit`` entry of every sidecar of one run (``keys``: the datasets it publishes)."""
    return {"id": uuid.uuid4().hex, "datasets": list(keys)}


def unit_of(prefix: str, cache_path: str | None = None) -> dict | None:
    """The unit recorded for ``prefix`` (None without a sidecar whose sizes match the files, or
    without a unit)."""
    unit = recorded_facts(prefix, cache_path).get("unit")
    return unit if isinstance(unit, dict) and "id" in unit else None


def check_pair(text_prefix: str, mask_prefix: str, cache_path: str | None = None) -> bool:
    """Whether ``mask_prefix`` is the loss mask of ``text_prefix`` (False: there is none).
    ``DatasetError`` when the text was made with its mask and the mask is missing, or when the
    mask on disk was not published with this text."""
    text = unit_of(text_prefix, cache_path)
    if not os.path.exists(mask_prefix + ".idx"):
        if text and "loss_mask" in text.get("datasets", ()):
            raise DatasetError(
                f"{text_prefix}: made by a --chat run, but its loss mask {mask_prefix}.idx is "
                "missing (publishing failed part way, or it was not copied). Training on it would "
                "put the loss on every token, user turns included; run tools/preprocess_data.py "
                "again, or copy the loss mask beside it")
        return False
    mask = unit_of(mask_prefix, cache_path)
    if text is None and mask is None:
        return True  # neither records a unit (Megatron-LM, an older version of the tool)
    if text is None or mask is None or text["id"] != mask["id"]:
        raise DatasetError(
            f"{mask_prefix} does not belong to {text_prefix}: they were not published by the same "
            f"preprocessing run (unit {_id(mask)} and {_id(text)}), so the mask would mark other "
            "tokens than the text's. Run tools/preprocess_data.py --chat again for this prefix, or "
            "remove the stale loss mask if the text is not chat data")
    return True


def _id(unit: dict | None) -> str:
    return unit["id"][:12] if unit else "none recorded"


def check_member(text_prefix: str, key: str, prefix: str, cache_path: str | None = None) -> None:
    """``prefix`` (the ``key`` dataset of an image run: ``images``, ``image_index``) is present and
    was published with ``text_prefix``; ``DatasetError`` naming both otherwise."""
    text = unit_of(text_prefix, cache_path)
    if not os.path.exists(prefix + ".idx"):
        raise DatasetError(f"{text_prefix}: made by an image run, but its {key} dataset {prefix}.idx "
                           "is missing (publishing failed part way, or it was not copied); run "
                           "tools/preprocess_data.py again, or copy it beside the text")
    IndexedDataset(prefix)  # a file missing or cut short is named as such, not as another run's
    other = unit_of(prefix, cache_path)
    if text is None or other is None or text["id"] != other["id"] or \
            key not in text.get("datasets", ()):
        raise DatasetError(f"{prefix} does not belong to {text_prefix}: they were not published by "
                           f"the same preprocessing run (unit {_id(other)} and {_id(text)}); run "
                           "tools/preprocess_data.py again for this prefix")
