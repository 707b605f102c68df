"""Whole-dataset statistics in a JSON sidecar, ``PREFIX.meta.json``.

Training needs facts that only a pass over the ``.bin`` can give: the smallest and largest token
id (every id must be below the model's vocabulary) and, for a chat loss mask, how many tokens
are training targets. ``IndexedDatasetWriter`` (and so ``tools/preprocess_data.py``) records
them as it writes; for a dataset without a sidecar (written by Megatron-LM, say) they are
computed once, in one sequential pass, and cached (``data/cache.py``: beside the dataset, or in
the user cache when that directory is read-only).

The sidecar holds, over all elements: ``min``, ``max`` (None when empty), ``nonzero`` and
``nonzero_first`` (nonzero elements that are the first of a sequence), plus ``identity``: the
sizes and modification times of the ``.bin`` and ``.idx``. A sidecar whose identity differs from
the files on disk is stale and ignored, so a rewritten dataset is never checked against old
numbers (a copy that does not keep modification times is recomputed once, keeping what the old
sidecar says of the tokenizer and the publishing unit, ``data/units.py``, when the sizes match).

On a loss mask, ``nonzero - nonzero_first`` is the number of training targets: a token's label
is the next token, so a document's first token is never a target (``data/thd.py``).
"""
from __future__ import annotations

import json
import os

import numpy as np

from data import cache

SUFFIX = ".meta.json"
FORMAT = 1
BLOCK = 1 << 26  # elements per step of a recomputation (64 Mi: bounded memory, cheap progress)


def empty_stats() -> dict:
    return {"min": None, "max": None, "nonzero": 0, "nonzero_first": 0}


def block_stats(flat: np.ndarray, starts: np.ndarray) -> dict:
    """Statistics of ``flat``; ``starts`` are the offsets in it of nonempty sequences."""
    if not flat.size:
        return empty_stats()
    integer = flat.dtype.kind in "iub"  # min / max of float data (not tokens) are not recorded
    return {"min": int(flat.min()) if integer else None, "max": int(flat.max()) if integer else None,
            "nonzero": int(np.count_nonzero(flat)), "nonzero_first": int(np.count_nonzero(flat[starts]))}


def merge(a: dict, b: dict) -> dict:
    lo = [v["min"] for v in (a, b) if v["min"] is not None]
    hi = [v["max"] for v in (a, b) if v["max"] is not None]
    return {"min": min(lo) if lo else None, "max": max(hi) if hi else None,
            "nonzero": a["nonzero"] + b["nonzero"],
            "nonzero_first": a["nonzero_first"] + b["nonzero_first"]}


def identity(bin_file: str, idx_file: str) -> dict:
    b, i = os.stat(bin_file), os.stat(idx_file)
    return {"bin_bytes": b.st_size, "idx_bytes": i.st_size,
            "bin_mtime_ns": b.st_mtime_ns, "idx_mtime_ns": i.st_mtime_ns}


def sidecar_bytes(stats: dict, ident: dict, extra: dict | None = None) -> bytes:
    doc = {"format": FORMAT, "identity": ident, "stats": stats, **(extra or {})}
    return (json.dumps(doc, indent=1) + "\n").encode()


def _sidecars(prefix: str, cache_path: str | None):
    for base in cache.read_bases(prefix, cache_path):
        try:
            with open(base + SUFFIX, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("format") == FORMAT:
            yield doc


def read_sidecar(prefix: str, cache_path: str | None = None) -> dict | None:
    """The current sidecar of ``prefix`` (beside it or cached), or None."""
    ident = identity(f"{prefix}.bin", f"{prefix}.idx")
    return next((d for d in _sidecars(prefix, cache_path) if d.get("identity") == ident), None)


def recorded_facts(prefix: str, cache_path: str | None = None) -> dict:
    """What the sidecar of ``prefix`` says beyond the statistics (the tokenizer, the publishing
    unit, an image run's processor settings): the current sidecar's, else a stale one's whose
    sizes match (a copy that did not keep modification times); {} when there is none."""
    doc = read_sidecar(prefix, cache_path)
    if doc is not None:
        return {k: v for k, v in doc.items() if k not in ("format", "identity", "stats")}
    return _kept_facts(prefix, cache_path)


def _kept_facts(prefix: str, cache_path: str | None) -> dict:
    """What a stale sidecar says beyond the statistics (the tokenizer, the publishing unit),
    when only the modification times differ (a copy that did not keep them): kept when the
    statistics are recomputed, so a copied dataset still knows where it came from."""
    ident = identity(f"{prefix}.bin", f"{prefix}.idx")
    sizes = {k: v for k, v in ident.items() if k.endswith("_bytes")}
    for doc in _sidecars(prefix, cache_path):
        old = doc.get("identity") or {}
        if {k: old.get(k) for k in sizes} == sizes:
            return {k: v for k, v in doc.items() if k not in ("format", "identity", "stats")}
    return {}


def compute_stats(ds, progress: bool = True) -> dict:
    """One sequential pass over ``ds`` (an IndexedDataset whose index has been validated, so
    the sequences lie back to back in order)."""
    from tqdm import tqdm

    data, itemsize = ds._bin, ds.dtype.itemsize
    n = data.size
    out = empty_stats()
    with tqdm(total=n, unit="tok", unit_scale=True, desc=f"scanning {os.path.basename(ds.prefix)}",
              disable=not progress or n < 4 * BLOCK) as bar:
        for a in range(0, n, BLOCK):
            b = min(a + BLOCK, n)
            # sequences starting in [a, b): pointers are sorted, so two binary searches
            lo, hi = np.searchsorted(ds.pointers, [a * itemsize, b * itemsize])
            starts = ds.pointers[lo:hi][ds.lengths[lo:hi] > 0] // itemsize - a
            out = merge(out, block_stats(np.asarray(data[a:b]), starts))
            bar.update(b - a)
    return out


def load_stats(ds, cache_path: str | None = None, progress: bool = True) -> dict:
    """The statistics of ``ds``: from its sidecar, or computed once and cached."""
    doc = read_sidecar(ds.prefix, cache_path)
    if doc is not None:
        return doc["stats"]
    stats = compute_stats(ds, progress)
    ident = identity(f"{ds.prefix}.bin", f"{ds.prefix}.idx")
    kept = _kept_facts(ds.prefix, cache_path)
    cache.save(cache.cache_bases(ds.prefix, cache_path), [SUFFIX],
               lambda _s, f: f.write(sidecar_bytes(stats, ident, kept)), f"statistics of {ds.prefix}")
    return stats
