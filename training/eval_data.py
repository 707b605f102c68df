"""Validation data: the validation part of ``--split`` (or ``--valid-data-path``) as a THD loader.

``--split 98,1,1`` cuts each dataset's documents contiguously: the first 98 % train (what
``data.loader.open_source(train_fraction=...)`` keeps, with the same boundary), the next 1 %
validate, the rest is the test part that nothing reads. The validation part gets its own pack
plan (cached like the training plan, under its own hash) and its own ``THDLoader``, so
evaluating never moves the training loader. Evaluations read the validation stream from its
start every time: the same packs, so successive validation losses compare.
"""
from __future__ import annotations

import numpy as np

from data.cp_shard import CPShardLoader
from data.indexed_dataset import IndexedDataset
from data.loader import PackedSource, THDLoader, _unpad_plan, loss_mask_prefix, open_source, parse_data_path
from data.packing import cached_plan
from data.image_store import open_images
from data.splits import split_bounds
from models import registry


def validation_ranges(pairs: list[tuple[float, str]], split: str) -> list[tuple[float, str, int, int]]:
    """(weight, prefix, first doc, end doc) of each dataset's validation part; ``ValueError``
    naming ``--split`` when a part holds no document."""
    out = []
    for w, prefix in pairs:
        n = len(IndexedDataset(prefix))
        lo, hi = split_bounds(n, split)
        if hi <= lo:
            raise ValueError(f"--split {split}: the validation part of {prefix} holds no document "
                             f"(it has {n}); raise the validation weight, or give --valid-data-path")
        out.append((w, prefix, lo, hi))
    return out


def _open_part(prefix: str, lo: int, hi: int, seq_length: int, long_docs: str, seed: int,
               cache_dir: str | None, pad_multiple: int = 1) -> PackedSource:
    """Documents ``[lo, hi)`` of ``prefix`` packed on their own (empty documents and documents
    whose loss mask has another length are left out, as ``open_source`` does)."""
    text = IndexedDataset(prefix)
    images = open_images(prefix, text.lengths, registry.image_processor_from_settings, cache_dir)
    mask_prefix = loss_mask_prefix(prefix, cache_dir)
    mask = IndexedDataset(mask_prefix) if mask_prefix else None
    lengths = text.lengths.astype(np.int64)
    if mask is not None:
        if len(mask) != len(text):
            raise ValueError(f"{mask_prefix}: {len(mask)} documents but {prefix} has {len(text)}")
        lengths[mask.lengths != text.lengths] = 0
    lengths[:lo] = 0
    lengths[hi:] = 0
    plan_lengths = (lengths + pad_multiple - 1) // pad_multiple * pad_multiple
    plan = cached_plan(plan_lengths, seq_length, prefix, long_docs=long_docs, seed=seed, cache_path=cache_dir)
    if pad_multiple != 1:  # planned on padded lengths: the segments carry the real ones
        plan = _unpad_plan(plan, text.lengths)
    if plan.num_packs == 0:
        raise ValueError(f"{prefix}: the validation part (documents {lo}..{hi - 1}) has no usable "
                         f"document with --long-docs {long_docs}")
    return PackedSource(prefix, text, mask, plan, {}, images)


def make_loader(sources, ps, mtp_depths: int, **kwargs) -> THDLoader:
    """This rank's loader: its data-parallel rank's micro-batches, cut to its CP rank's shard
    under context parallelism (``data/cp_shard.py``)."""
    kwargs["with_images"] = ps.is_first_stage  # only the first stage's vision tower reads them
    if ps.sizes.cp > 1:
        return CPShardLoader(sources, cp_size=ps.sizes.cp, cp_rank=ps.cp_rank, mtp_depths=mtp_depths,
                             dp_rank=ps.dp_rank, dp_size=ps.sizes.dp, **kwargs)
    return THDLoader(sources, dp_rank=ps.dp_rank, dp_size=ps.sizes.dp, **kwargs)


def validation_loader(args, pad_id: int, ps, mtp_depths: int = 0) -> THDLoader:
    """This rank's validation micro-batches (same shapes and padding as training)."""
    d, e, seed = args.data, args.eval, args.schedule.seed
    pad = d.pad_multiple(ps.sizes.cp)
    if e.valid_data_path:
        sources = [(w, open_source(prefix, d.seq_length, d.long_docs, seed, pad_multiple=pad,
                                   cache_dir=d.data_cache_path, image_processor=registry.image_processor_from_settings))
                   for w, prefix in parse_data_path(e.valid_data_path)]
    else:
        sources = [(w, _open_part(prefix, lo, hi, d.seq_length, d.long_docs, seed, d.data_cache_path, pad))
                   for w, prefix, lo, hi in validation_ranges(parse_data_path(d.data_path), d.split)]
    return make_loader(sources, ps, mtp_depths, seq_length=d.seq_length, micro_batch_size=d.micro_batch_size,
                       pad_id=pad_id, seed=seed, pad_multiple=pad)
