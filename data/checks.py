"""The data checked against the model before training starts (no process group exists yet).

``training/run_files.check_data_files`` calls :func:`check_training_data` for every ``--data-path`` prefix:

* the index is validated in full (``IndexedDataset`` at open);
* every token id lies in ``[0, vocab_size)``: an id at or above the model's vocabulary is an
  ``IndexError`` in the embedding on CPU and a device-side assert on GPU, many minutes into a
  run. The ids come from the data (its statistics sidecar, ``data/dataset_stats.py``), not from
  ``--tokenizer-type``, which may not be what the data was made with;
* the data has training targets: a label is the next token of the same document, so a corpus of
  one-token documents, or a chat loss mask that marks nothing after a document's first token,
  trains on nothing (the loss reads 0.0000). No targets at all is refused; fewer than
  ``MIN_TARGET_FRACTION`` of the tokens is warned about, with the numbers;
* the run's tokenizer is the one the data was made with (:func:`check_made_with`): the same
  vocabulary (its fingerprint, ``data/tokenizers.py``) and, for image + text data, the same image
  processor in its folder (settings, image token, special tokens). The checkpoint records the
  run's ``--tokenizer-model``, and ``tools/generate.py`` (``--image``) reads the vocabulary and the
  image processor from there: another folder would sample garbage.
"""
from __future__ import annotations

import json
import os
import warnings

import numpy as np

from data.dataset_stats import load_stats, read_sidecar, recorded_facts
from data.indexed_dataset import IndexedDataset
from data.loader import loss_mask_prefix

MIN_TARGET_FRACTION = 0.01


def trainable_targets(text: IndexedDataset, mask_stats: dict | None) -> int:
    """Tokens that are some token's label: each document's tokens but its first (text), or the
    loss-mask ones that are not a document's first token (chat)."""
    if mask_stats is not None:
        return mask_stats["nonzero"] - mask_stats["nonzero_first"]
    return text.num_tokens - int(np.count_nonzero(text.lengths))


def check_training_data(prefix: str, vocab_size: int, cache_path: str | None = None) -> dict:
    """Raise ``ValueError`` naming ``--data-path PREFIX`` if the dataset cannot train a model
    with ``vocab_size`` embeddings; warn if it has almost no targets. Returns the numbers."""
    text = IndexedDataset(prefix)
    stats = load_stats(text, cache_path)
    mask_stats = _mask_stats(prefix, cache_path)
    lo, hi = stats["min"], stats["max"]
    if hi is not None and (hi >= vocab_size or lo < 0):
        bad = hi if hi >= vocab_size else lo
        raise ValueError(
            f"--data-path {prefix}: token id {bad} is outside the model's vocabulary of "
            f"{vocab_size} (ids 0..{vocab_size - 1}){_made_with(prefix, cache_path)}. Tokenise the "
            "data with the model's tokenizer, or use a model whose vocab_size covers every id.")
    tokens = text.num_tokens
    targets = trainable_targets(text, mask_stats)
    if targets <= 0:
        why = ("its loss mask marks no token after a document's first" if mask_stats is not None
               else "every document is at most one token long, and a document's last token has "
                    "no label")
        raise ValueError(f"--data-path {prefix}: no training targets in {tokens:,} tokens and "
                         f"{len(text):,} documents: {why}. Training on it would report a loss of "
                         "0 and learn nothing.")
    if targets < MIN_TARGET_FRACTION * tokens:
        warnings.warn(f"--data-path {prefix}: only {targets:,} of {tokens:,} tokens "
                      f"({targets / tokens:.3%}) are training targets (fewer than "
                      f"{MIN_TARGET_FRACTION:.0%}); check the documents' lengths"
                      f"{' and the loss mask' if mask_stats is not None else ''}", stacklevel=2)
    return {"tokens": tokens, "targets": targets, "max_token_id": hi}


def _mask_stats(prefix: str, cache_path: str | None) -> dict | None:
    """The statistics of the loss mask beside ``prefix``, after checking that it is this
    text's (``data/units.py``; statistics first: recomputing a stale sidecar keeps its unit)."""
    guess = prefix.replace("_text_document", "_loss_mask_document")
    ds = IndexedDataset(guess) if guess != prefix and os.path.exists(guess + ".idx") else None
    mask_stats = load_stats(ds, cache_path) if ds is not None else None
    return mask_stats if loss_mask_prefix(prefix, cache_path) else None


def _made_with(prefix: str, cache_path: str | None) -> str:
    """'; the data was made with --tokenizer-type T (vocabulary V)' when the sidecar says so."""
    tok = (read_sidecar(prefix, cache_path) or {}).get("tokenizer")
    if not tok:
        return ""
    model = f" --tokenizer-model {tok['model']}" if tok.get("model") else ""
    return (f"; the data was made with --tokenizer-type {tok['type']}{model} (vocabulary "
            f"{tok['vocab_size']:,})")


def check_made_with(prefix: str, tok, tokenizer_type: str, tokenizer_model: str | None,
                    load_image_processor=None, cache_path: str | None = None) -> None:
    """``ValueError`` naming both when ``tok`` (``--tokenizer-type`` / ``--tokenizer-model``) is
    not what ``--data-path prefix`` was made with: another vocabulary (by fingerprint; by size for
    data of an earlier version), or for image data another image processor in the folder
    (``load_image_processor(folder, token_id)``: the model registry's). Data that records no
    tokenizer (Megatron-LM's) is not checked."""
    facts = recorded_facts(prefix, cache_path)
    made = facts.get("tokenizer")
    if not isinstance(made, dict) or not made.get("type"):
        return
    was, given = _flags(made["type"], made.get("model")), _flags(tokenizer_type, tokenizer_model)

    def refuse(what: str):
        raise ValueError(
            f"--data-path {prefix} was made with {was}, but this run has {given}: {what}. The "
            "checkpoint records the run's tokenizer, and tools/generate.py reads the vocabulary (and "
            f"the image processor) from it. Train with {was}, or preprocess the data again with {given}")

    if made.get("fingerprint") not in (None, tok.fingerprint()):
        refuse(f"another vocabulary (fingerprint {made['fingerprint']} -> {tok.fingerprint()}, "
               f"{made.get('vocab_size')} -> {tok.vocab_size} tokens)")
    if made.get("fingerprint") is None and made.get("vocab_size") not in (None, tok.vocab_size):
        refuse(f"another vocabulary ({made['vocab_size']} -> {tok.vocab_size} tokens)")
    images = facts.get("images")
    if not isinstance(images, dict) or load_image_processor is None:
        return
    try:
        proc = load_image_processor(tokenizer_model, tok.token_id) if tokenizer_model else None
    except (OSError, ValueError) as e:
        refuse(f"the data holds images, and the tokenizer gives no image processor ({e})")
    if proc is None:
        refuse("the data holds images, and the tokenizer is not a processor folder")
    now = json.loads(json.dumps({"processor": proc.settings, "token_ids": proc.token_ids,
                                 "image_token_id": proc.image_token_id}))
    diffs = [f"image_token_id {images.get('image_token_id')} -> {now['image_token_id']}"] \
        if images.get("image_token_id") != now["image_token_id"] else []
    for key in ("processor", "token_ids"):
        a, b = images.get(key) or {}, now[key]
        diffs += [f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    if diffs:
        refuse(f"another image processor ({'; '.join(diffs[:6])}{' ...' if len(diffs) > 6 else ''})")


def _flags(kind: str, model: str | None) -> str:
    return f"--tokenizer-type {kind}" + (f" --tokenizer-model {model}" if model else "")
