"""The micro-batches a trace runs: what the loader would hand this rank, with made-up tokens.

Each micro-batch is ``--micro-batch-size`` packs of ``--seq-length`` tokens, each pack one
document (every token but the last a target; under ``--overlap-moe-expert-parallel-comm`` two
documents of half a pack each, so that the overlap cuts every block's tokens into the halves the
planner assumes, ``training/planner/overlap.py``: with one document a pack, a block run a pack at
a time, ``--recompute-chunks``, would cut none and trace no second chunk), built by the loader's own ``build_thd_batch`` (and
cut by ``data/cp_shard.shard_batch`` under context parallelism), so the host metadata a step reads
(target count, boundaries) comes as in a real run. Small host tensors: the model's ops turn them
into fake ones."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from core.packed_seq import ImageInputs
from data.cp_shard import shard_batch
from data.thd import IGNORE_INDEX, build_thd_batch
from models.registry import shapes_of


class _Tokens:
    """An indexed dataset of made-up token ids (``get(doc, start, length)``)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def get(self, doc: int, start: int, length: int) -> np.ndarray:
        return self.rng.integers(0, self.vocab, length, dtype=np.int64)


def trace_batches(cfg, args, ps, num_microbatches: int) -> list:
    """This rank's micro-batches of text (host tensors); ``with_images`` adds the images."""
    d = args.data
    text = _Tokens(cfg.vocab_size, args.schedule.seed)
    half = d.seq_length // 2
    pack = np.array([[0, 0, half], [1, 0, d.seq_length - half]] if args.parallel.overlap_moe_expert_parallel_comm
                    else [[0, 0, d.seq_length]], dtype=np.int64)
    out = []
    for _ in range(num_microbatches):
        b = build_thd_batch([pack] * d.micro_batch_size, text, d.seq_length, pad_id=0)
        if ps.sizes.cp > 1:
            b = shard_batch(b, ps.sizes.cp, ps.cp_rank, cfg.num_mtp_layers)
        out.append(b)
    return out


def images_per_pack(cfg, mix, seq_length: int) -> tuple[int, int, int]:
    """``(images, crops per image, features per image)`` of a pack with ``--image-token-share``
    of its tokens image features (``mix``: the planner's ``ImageMix``; the crops rounded to a
    whole number): (0, 0, 0) without images."""
    v = shapes_of(cfg).vision
    if mix is None or not mix.image_token_share or v is None:
        return 0, 0, 0
    crops = round(mix.image_crops_per_image) if v.crop_size else 0
    f = v.features(v.image_size) + crops * (v.features(v.crop_size) if crops else 0)
    return max(1, round(mix.image_token_share * seq_length / f)), crops, f


def with_images(batches: list, cfg, mix, seq_length: int, dtype: torch.dtype) -> list:
    """The micro-batches with their images: each pack's first placeholders (no target) and
    the pixels as the loader gives them. Call under the trace's fake mode: the pixels are made
    there (counted, as their device copy would be), the positions are host tensors."""
    n, crops, f = images_per_pack(cfg, mix, seq_length)
    if not n:
        return batches
    v = shapes_of(cfg).vision
    out = []
    for b in batches:
        packs = b.tokens.numel() // seq_length
        positions = np.concatenate([p * seq_length + np.arange(n * f) for p in range(packs)])
        labels = b.labels.clone()
        labels[torch.from_numpy(positions)] = IGNORE_INDEX
        images = ImageInputs(torch.empty(packs * n, 3, v.image_size, v.image_size, dtype=dtype),
                             torch.empty(packs * n * crops, 3, v.crop_size, v.crop_size, dtype=dtype) if crops
                             else None, (crops,) * (packs * n), torch.from_numpy(positions))
        out.append(dataclasses.replace(b, labels=labels, images=images,
                                       host_targets=b.num_target_tokens - packs * n * f))
    return out
