"""THD micro-batches: packs of document segments -> tokens, labels, position ids, cu_seqlens.

The contract (``../shared/DESIGN.md``): ``micro_batch_size`` packs of exactly ``seq_length``
tokens flattened to ``T``; position ids restart at 0 for every document; ``labels[i]`` is the
next token of the same document, or -100 at a document's last token, on padding, and where the
loss mask (chat data) says the next token is not a target. ``cu_seqlens`` counts real tokens;
``cu_seqlens_padded`` pads each document to ``pad_multiple`` and folds a pack's trailing pad into
its last document, so its last entry is ``T``.

Layout of one pack (pad_multiple = 4, S = 16, documents of 5 and 6 tokens)::

    tokens    a a a a a _ _ _ b b b b b b _ _
    positions 0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7
    labels    a a a a - - - - b b b b b - - -     (shifted: each is the next token)
    cu_seqlens = [0, 5, 11]   cu_seqlens_padded = [0, 8, 16]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from core.batch_copy import pin
from core.packed_seq import ImageInputs, PackedSeqParams
from data.image_store import batch_images

IGNORE_INDEX = -100


@dataclass
class THDBatch:
    tokens: torch.Tensor        # int64 [T]
    labels: torch.Tensor        # int64 [T], IGNORE_INDEX where there is no target
    position_ids: torch.Tensor  # int64 [T]
    packed_seq_params: PackedSeqParams
    images: ImageInputs | None = None  # the images of image + text documents (first stage only)
    host_targets: int | None = None    # target tokens as a host int (counted from the host labels)

    def __post_init__(self) -> None:
        if self.host_targets is None and self.labels.device.type == "cpu":
            self.host_targets = int((self.labels != IGNORE_INDEX).sum())  # host memory: no sync

    def to(self, device, non_blocking: bool = False) -> "THDBatch":
        move = lambda t: t.to(device, non_blocking=non_blocking)
        return THDBatch(move(self.tokens), move(self.labels), move(self.position_ids),
                        self.packed_seq_params.to(device, non_blocking),
                        None if self.images is None else self.images.to(device, non_blocking),
                        self.num_target_tokens)

    def pin_memory(self) -> "THDBatch":
        """In pinned host memory when CUDA is available (torch's DataLoader calls this)."""
        return pin(self)

    @property
    def num_target_tokens(self) -> int:
        """Labels that are targets: the host count (read on the device only for a batch built there)."""
        return self.host_targets if self.host_targets is not None else int((self.labels != IGNORE_INDEX).sum())


def _round_up(x: np.ndarray | int, m: int):
    return (x + m - 1) // m * m


def build_thd_batch(packs: list[np.ndarray], text, seq_length: int, pad_id: int, *,
                    loss_mask=None, pad_multiple: int = 1, images=None) -> THDBatch:
    """Assemble one micro-batch from ``packs`` (each an int64 ``[n, 3]`` array of segments).

    ``text`` / ``loss_mask`` are indexed datasets (anything with ``get(doc, start, length)``);
    ``images`` the dataset's :class:`data.image_store.ImageStore` (image + text data), which
    gives the batch its ``images``. Raises ``ValueError`` if a pack does not fit ``seq_length``
    once documents are padded, or a segment cuts through an image's placeholder run.
    """
    T = len(packs) * seq_length
    tokens = np.full(T, pad_id, dtype=np.int64)
    labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
    positions = np.empty(T, dtype=np.int64)
    real, padded, placed = [], [], []
    for p, segs in enumerate(packs):
        base = p * seq_length
        seg_len = segs[:, 2]
        seg_pad = _round_up(seg_len, pad_multiple)
        if int(seg_pad.sum()) > seq_length:
            raise ValueError(f"pack {p} holds {int(seg_pad.sum())} tokens after padding documents "
                             f"to multiples of {pad_multiple}, more than seq_length {seq_length}; "
                             "plan packs with padded lengths")
        seg_pad[-1] += seq_length - int(seg_pad.sum())  # trailing pad folded into the last document
        pos = base
        for (doc, start, n), width in zip(segs.tolist(), seg_pad.tolist()):
            toks = text.get(doc, start, n)
            tokens[pos:pos + n] = toks
            # labels[i] = tokens[i+1] inside the document; the last token has no target
            labels[pos:pos + n - 1] = toks[1:]
            if loss_mask is not None:
                keep = loss_mask.get(doc, start, n)[1:].astype(bool)
                labels[pos:pos + n - 1][~keep] = IGNORE_INDEX
            positions[pos:pos + width] = np.arange(width)
            placed.append((images, doc, start, n, pos))
            pos += width
        real.append(seg_len)
        padded.append(seg_pad)
    real_len, pad_len = np.concatenate(real), np.concatenate(padded)
    cu = np.zeros(len(real_len) + 1, dtype=np.int32)
    cu_pad = np.zeros(len(real_len) + 1, dtype=np.int32)
    np.cumsum(real_len, out=cu[1:])
    np.cumsum(pad_len, out=cu_pad[1:])
    params = PackedSeqParams(torch.from_numpy(cu), torch.from_numpy(cu_pad),
                             int(real_len.max()) if len(real_len) else 0)
    batch_imgs = batch_images(placed, tokens) if images is not None else None
    return THDBatch(torch.from_numpy(tokens), torch.from_numpy(labels),
                    torch.from_numpy(positions), params, batch_imgs)
