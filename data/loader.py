"""Deterministic, resumable, data-parallel iterator of THD micro-batches over packed datasets.

The global stream of packs is a pure function of the datasets, the blending weights and the
seed: global pack ``k`` belongs to dataset ``d(k)`` (a fixed blending pattern, Megatron's
``--data-path 0.7 A 0.3 B``), and is that dataset's ``j``-th pack, i.e. pack
``perm_e[j mod P]`` of epoch ``e = j // P`` (each epoch a fresh seeded shuffle of the plan).
Data-parallel rank ``r`` of ``R`` takes global micro-batches ``r, r + R, r + 2R, ...``, each
``micro_batch_size`` consecutive packs, so ranks never share a pack, and every pipeline stage of
one rank computes the same sequence on its own. The state is one integer (packs consumed, all
ranks together) and a fingerprint of everything the stream depends on: the stream's flags and,
per dataset, its documents' lengths in order and a sample of its tokens.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from core.packed_seq import PackedSeqParams
from data.dataset_stats import recorded_facts
from data.image_store import ImageStore, check_cut_runs, concat_images, has_images, open_images
from data.indexed_dataset import IndexedDataset
from data.packing import PackPlan, cached_plan, permutation
from data.thd import THDBatch, build_thd_batch
from data.units import check_pair

BLEND_PERIOD = 10_000  # the blending pattern repeats every this many packs
FINGERPRINT_VERSION = 2  # of the loader state: 2 counts packs and fingerprints each dataset
SAMPLE_SEGMENTS = 64     # plan segments whose first tokens the fingerprint reads
SAMPLE_TOKENS = 32
_STREAM_NAMES = {"weights": "--data-path weights", "pad_multiple": "pad multiple"}


def parse_data_path(args: list[str]) -> list[tuple[float, str]]:
    """``["A"]`` or ``["0.7", "A", "0.3", "B"]`` (Megatron's syntax) -> [(weight, prefix)]."""
    if len(args) == 1:
        return [(1.0, args[0])]
    if len(args) % 2:
        raise ValueError("--data-path: give one prefix, or weight-prefix pairs like '0.7 A 0.3 B'")
    pairs = []
    for w, prefix in zip(args[::2], args[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"--data-path: {w!r} is not a weight (expected 'WEIGHT PREFIX' pairs)") from None
        if not (math.isfinite(weight) and weight > 0):  # nan fails every comparison: test it
            raise ValueError(f"--data-path: weight {w!r} for {prefix} must be a finite number > 0")
        pairs.append((weight, prefix))
    return pairs


def blend_pattern(weights: list[float], period: int = BLEND_PERIOD) -> np.ndarray:
    """Dataset of each of ``period`` consecutive packs: greedy on the largest deficit, so every
    prefix of the pattern tracks the weights as closely as whole packs allow."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.zeros(len(w))
    out = np.empty(period, dtype=np.int64)
    for i in range(period):
        d = int(np.argmax(w * (i + 1) - counts))
        out[i] = d
        counts[d] += 1
    return out


@dataclass
class PackedSource:
    """One dataset prefix, its (optional) chat loss mask, its cached pack plan, and its images
    (image + text data, ``data/image_store.py``)."""

    prefix: str
    text: IndexedDataset
    loss_mask: IndexedDataset | None
    plan: PackPlan
    skipped: dict
    images: ImageStore | None = None


def loss_mask_prefix(prefix: str, cache_path: str | None = None) -> str | None:
    """The chat loss mask dataset beside ``PREFIX`` (``..._loss_mask_document``), if any.
    ``ValueError`` when the text was made with a mask that is missing, or the mask beside it
    was published by another run (``data/units.py``)."""
    mask_prefix = prefix.replace("_text_document", "_loss_mask_document")
    if mask_prefix == prefix:
        return None
    return mask_prefix if check_pair(prefix, mask_prefix, cache_path) else None


def open_source(prefix: str, seq_length: int, long_docs: str, seed: int,
                pad_multiple: int = 1, train_fraction: float = 1.0,
                cache_dir: str | None = None, image_processor=None) -> PackedSource:
    """Open ``PREFIX`` (``..._text_document``) and plan its packs, skipping unusable documents.

    The text and the loss mask are read checked against the block checksums their sidecars
    record (``data/checksums.py``; a dataset without them is read unchecked).
    Zero-length documents and documents whose loss mask length differs from their token count
    are left out of the plan, counted and reported once (with their ids). ``train_fraction``
    keeps only the first part of the documents (``--split``; the rest is held out).
    ``cache_dir`` (``--data-cache-path``) is where the pack plan is cached; by default beside
    the dataset, or the user cache when that directory is read-only (``data/cache.py``).
    ``image_processor``: for a dataset with images, the processor or a ``settings -> processor``
    factory (``data/image_store.open_images``); a dataset with images refuses to open without.
    """
    text = IndexedDataset(prefix)
    mask_prefix = loss_mask_prefix(prefix, cache_dir)
    mask = IndexedDataset(mask_prefix) if mask_prefix else None
    for ds in (text, mask) if mask is not None else (text,):  # each block checked when first read
        ds.verify_with(recorded_facts(ds.prefix, cache_dir).get("checksums"))
    lengths = text.lengths.astype(np.int64)
    skipped = {"empty": np.flatnonzero(lengths == 0)}
    if mask is not None:
        if len(mask) != len(text):
            raise ValueError(f"{mask_prefix}: {len(mask)} documents but {prefix} has {len(text)}")
        skipped["mask_length_mismatch"] = np.flatnonzero(mask.lengths != text.lengths)
        lengths[skipped["mask_length_mismatch"]] = 0
    for why, ids in skipped.items():
        if len(ids):
            warnings.warn(f"{prefix}: skipping {len(ids)} document(s) ({why}): ids "
                          f"{ids[:10].tolist()}{' ...' if len(ids) > 10 else ''}", stacklevel=2)
    if train_fraction < 1.0:
        lengths[max(1, int(len(lengths) * train_fraction)):] = 0
    plan_lengths = lengths if pad_multiple == 1 else (lengths + pad_multiple - 1) // pad_multiple * pad_multiple
    plan = cached_plan(plan_lengths, seq_length, prefix, long_docs=long_docs, seed=seed,
                       cache_path=cache_dir)
    if pad_multiple != 1:  # the plan holds padded lengths; segments must carry the real ones
        plan = _unpad_plan(plan, text.lengths)
    if plan.num_packs == 0:
        raise ValueError(f"{prefix}: no packs (no usable documents with --long-docs {long_docs})")
    images = open_images(prefix, text.lengths, image_processor, cache_dir)
    if images is not None:  # a plan that cuts an image's run fails now, not packs later
        check_cut_runs(images, plan.segments, long_docs)
    return PackedSource(prefix, text, mask, plan, {k: len(v) for k, v in skipped.items()}, images)


def _unpad_plan(plan: PackPlan, real_lengths: np.ndarray) -> PackPlan:
    segs = np.array(plan.segments)
    real_end = np.minimum(segs[:, 1] + segs[:, 2], real_lengths[segs[:, 0]])
    segs[:, 2] = np.maximum(real_end - segs[:, 1], 0)
    return PackPlan(plan.pack_offsets, segs, plan.seq_length, **plan.counts(), key=plan.key)


class THDLoader:
    """Iterator of :class:`THDBatch` for one data-parallel rank (see module docstring)."""

    def __init__(self, sources: list[tuple[float, PackedSource]], *, seq_length: int,
                 micro_batch_size: int, pad_id: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, pad_multiple: int = 1, with_images: bool = True,
                 pixel_dtype: torch.dtype = torch.float32):
        """``with_images``: build ``THDBatch.images`` for image + text data (False on pipeline
        stages that do not run the vision tower: no image is decoded there). ``pixel_dtype``:
        of the images' pixels (bf16 under ``--bf16``: the tower casts them to its bf16 compute
        weights' dtype anyway, so the cast moves here, bit for bit, and halves what crosses to
        the device)."""
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, {dp_size})")
        if seq_length % pad_multiple:
            raise ValueError(f"--seq-length {seq_length} must be a multiple of pad_multiple {pad_multiple}")
        if micro_batch_size < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
        self.sources = [s for _, s in sources]
        for s in self.sources:
            if s.images is None and has_images(s.prefix):
                raise ValueError(f"{s.prefix} holds images but was opened without them: open it "
                                 "with open_source(..., image_processor=...) (docs/vlm.md)")
        self.seq_length, self.micro_batch_size = seq_length, micro_batch_size
        self.pad_id, self.pad_multiple, self.seed = pad_id, pad_multiple, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.with_images, self.pixel_dtype = with_images, pixel_dtype
        self.pattern = blend_pattern([w for w, _ in sources])
        self.per_period = np.bincount(self.pattern, minlength=len(self.sources))
        # rank_in_period[i]: how many packs of pattern[i]'s dataset come before position i
        self.rank_in_period = np.zeros(BLEND_PERIOD, dtype=np.int64)
        seen = np.zeros(len(self.sources), dtype=np.int64)
        for i, d in enumerate(self.pattern):
            self.rank_in_period[i] = seen[d]
            seen[d] += 1
        self.weights = [w / sum(w for w, _ in sources) for w, _ in sources]
        self._orders: dict = {}
        self._ident: dict | None = None
        self.consumed = 0  # micro-batches this rank has produced

    def fingerprint(self) -> str:
        """One hash of everything the stream of packs depends on (see :meth:`state_dict`)."""
        return self._identity()["fingerprint"]

    def _identity(self) -> dict:
        if self._ident is None:
            stream = {"seq_length": self.seq_length, "seed": self.seed,
                      "pad_multiple": self.pad_multiple,
                      "weights": [round(float(w), 12) for w in self.weights]}
            datasets = [{"prefix": s.prefix, "fingerprint": source_fingerprint(s)} for s in self.sources]
            key = [FINGERPRINT_VERSION, stream, [d["fingerprint"] for d in datasets]]
            self._ident = {"stream": stream, "datasets": datasets,
                           "fingerprint": hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}
        return self._ident

    def _epoch_order(self, d: int, epoch: int) -> np.ndarray:
        """Pack order of dataset ``d`` in ``epoch``: the plan's own (seeded) order first, then a
        fresh seeded shuffle per epoch. Kept for the last few (dataset, epoch) pairs."""
        key = (d, epoch)
        if key not in self._orders:
            n = self.sources[d].plan.num_packs
            if len(self._orders) >= 2 * len(self.sources):
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = (np.arange(n) if epoch == 0 else
                                 permutation(n, self.seed * 1_000_003 + epoch * 7919 + d))
        return self._orders[key]

    def global_pack(self, k: int) -> tuple[int, np.ndarray]:
        """(dataset index, segments) of global pack ``k``."""
        period, i = divmod(k, BLEND_PERIOD)
        d = int(self.pattern[i])
        j = period * int(self.per_period[d]) + int(self.rank_in_period[i])
        plan = self.sources[d].plan
        epoch, idx = divmod(j, plan.num_packs)
        return d, plan.pack(int(self._epoch_order(d, epoch)[idx]))

    def micro_batch(self, m: int) -> THDBatch:
        """This rank's ``m``-th micro-batch (pure: no state is read or changed)."""
        g = m * self.dp_size + self.dp_rank
        packs = [self.global_pack(g * self.micro_batch_size + i) for i in range(self.micro_batch_size)]
        srcs = {d for d, _ in packs}
        if len(srcs) == 1:
            src = self.sources[srcs.pop()]
            batch = build_thd_batch([p for _, p in packs], src.text, self.seq_length, self.pad_id,
                                    loss_mask=src.loss_mask, pad_multiple=self.pad_multiple,
                                    images=self._images(src))
        else:
            batch = _concat([build_thd_batch([p], self.sources[d].text, self.seq_length, self.pad_id,
                                             loss_mask=self.sources[d].loss_mask,
                                             pad_multiple=self.pad_multiple,
                                             images=self._images(self.sources[d])) for d, p in packs])
        if batch.images is not None and self.pixel_dtype != torch.float32:
            img = batch.images
            local = None if img.pixel_values_local is None else img.pixel_values_local.to(self.pixel_dtype)
            batch.images = dataclasses.replace(img, pixel_values=img.pixel_values.to(self.pixel_dtype),
                                               pixel_values_local=local)
        return batch

    def _images(self, src: PackedSource):
        return src.images if self.with_images else None

    def __iter__(self):
        return self

    def __next__(self) -> THDBatch:
        batch = self.micro_batch(self.consumed)
        self.consumed += 1
        return batch

    def state_dict(self) -> dict:
        """Global packs consumed (all DP ranks move in step), so a run can resume with another
        data-parallel or micro-batch size and neither skip nor repeat a pack, and what the
        stream depends on: the stream's flags, and each dataset's fingerprint
        (:func:`source_fingerprint`), so a resume on other data is refused naming the dataset."""
        return {"version": FINGERPRINT_VERSION,
                "global_packs": self.consumed * self.dp_size * self.micro_batch_size, **self._identity()}

    def load_state_dict(self, state: dict, ignore_fingerprint: bool = False) -> list[str]:
        """Continue where ``state`` left off. ``ValueError`` when the data or the stream's flags
        differ from the saved ones, naming each difference; with ``ignore_fingerprint`` they are
        returned instead (for the caller to report) and the position is kept."""
        if state.get("version") == FINGERPRINT_VERSION:
            packs, diffs = int(state["global_packs"]), self._differences(state)
        else:  # before version 2: micro-batches, and a fingerprint of sizes and counts only
            packs = int(state["global_consumed"]) * self.micro_batch_size
            diffs = [] if state["fingerprint"] == self._legacy_fingerprint() else [
                "the datasets, blend weights, --seq-length, --micro-batch-size or --seed differ "
                "(a checkpoint of an older version: which one is not recorded)"]
        if diffs and not ignore_fingerprint:
            raise ValueError(
                f"the data differs from the checkpoint's: {'; '.join(diffs)}. Resuming would train "
                "on other data than the interrupted run from the next iteration on. Resume with "
                "the data and flags it was saved with, or pass --ignore-data-fingerprint to "
                f"continue at the same position ({packs:,} packs) in this data on purpose")
        per_step = self.dp_size * self.micro_batch_size
        if packs % per_step:
            raise ValueError(f"the checkpoint consumed {packs:,} packs, not a multiple of "
                             f"--micro-batch-size x data-parallel size = {per_step}: resume with a "
                             "micro-batch and data-parallel size that divide it")
        self.consumed = packs // per_step
        return diffs

    def _differences(self, state: dict) -> list[str]:
        now, diffs = self._identity(), []
        for k, v in state["stream"].items():
            if now["stream"].get(k) != v:
                name = _STREAM_NAMES.get(k, f"--{k.replace('_', '-')}")
                diffs.append(f"{name} {v} -> {now['stream'].get(k)}")
        old, new = state["datasets"], now["datasets"]
        if len(old) != len(new):
            names = [", ".join(d["prefix"] for d in x) for x in (old, new)]
            return diffs + [f"--data-path: {len(old)} dataset(s) ({names[0]}) -> {len(new)} ({names[1]})"]
        if diffs:  # a changed flag changes every dataset's packs: it says it all
            return diffs
        for a, b in zip(old, new):
            if a["fingerprint"] != b["fingerprint"]:
                diffs.append(f"--data-path {b['prefix']}: its documents are not the checkpoint's "
                             f"{a['prefix']} (their lengths, order or tokens, or --long-docs, "
                             f"differ: fingerprint {a['fingerprint']} -> {b['fingerprint']})")
        return diffs

    def _legacy_fingerprint(self) -> str:
        parts = [[s.prefix, s.text.num_tokens, len(s.text), s.plan.num_packs] for s in self.sources]
        key = [parts, self.pattern[:100].tolist(), self.seq_length, self.micro_batch_size,
               self.seed, self.pad_multiple]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def source_fingerprint(src: PackedSource) -> str:
    """What decides one dataset's packs, cheaply: the plan's key, a hash of every planned
    document's length in order (with --seq-length, --long-docs and the seed), and the first
    ``SAMPLE_TOKENS`` tokens (and loss-mask values) of ``SAMPLE_SEGMENTS`` segments spread over
    the plan. Lengths catch a reordered or re-tokenized dataset in all but contrived cases; the
    sample catches what lengths cannot (documents of equal lengths reordered, another tokenizer
    with the same lengths) at a fixed cost of a few dozen small reads, where hashing every token
    would read the whole dataset at each start."""
    plan = src.plan
    h = hashlib.sha256(plan.key.encode())
    if not plan.key:  # a plan made without cached_plan: the plan itself stands for the lengths
        h.update(np.ascontiguousarray(plan.segments).tobytes())
        h.update(np.ascontiguousarray(plan.pack_offsets).tobytes())
    n = len(plan.segments)
    for row in np.unique(np.linspace(0, n - 1, min(n, SAMPLE_SEGMENTS)).astype(np.int64)) if n else ():
        doc, start, length = (int(x) for x in plan.segments[row])
        take = min(length, SAMPLE_TOKENS)
        h.update(np.ascontiguousarray(src.text.get(doc, start, take)).astype("<i8").tobytes())
        if src.loss_mask is not None:
            h.update(np.ascontiguousarray(src.loss_mask.get(doc, start, take)).astype("u1").tobytes())
    return h.hexdigest()[:16]


def _concat(batches: list[THDBatch]) -> THDBatch:
    """Join single-pack batches (from different datasets) into one micro-batch."""
    offset, cu, cu_pad, real_offset = 0, [torch.zeros(1, dtype=torch.int32)], \
        [torch.zeros(1, dtype=torch.int32)], 0
    for b in batches:
        p = b.packed_seq_params
        cu.append(p.cu_seqlens[1:] + real_offset)
        cu_pad.append(p.cu_seqlens_padded[1:] + offset)
        real_offset += int(p.cu_seqlens[-1])
        offset += b.tokens.numel()
    params = PackedSeqParams(torch.cat(cu), torch.cat(cu_pad),
                             max(b.packed_seq_params.max_seqlen for b in batches))
    starts = np.cumsum([0] + [b.tokens.numel() for b in batches[:-1]]).tolist()
    return THDBatch(torch.cat([b.tokens for b in batches]), torch.cat([b.labels for b in batches]),
                    torch.cat([b.position_ids for b in batches]), params,
                    concat_images([b.images for b in batches], starts))
