"""The CPU ``sdpa`` backend: THD attention in a few ``scaled_dot_product_attention`` calls.

Per-call overhead, not arithmetic, sets the pace of small attention on a CPU, so the pack is
cut into a handful of *pieces* (host integers only, from :class:`DocLayout`), each one call:

* ``band``: a run of consecutive documents, its queries in blocks of ``block`` against the
  ``block + width - 1`` keys the block can see (the ``width - 1`` before it and its own),
  stacked as the batch dimension of one call; a mask (same document, causal, inside the
  window) lets each query see only its keys, across the run's document boundaries.
  ``width`` is the window, or the run's longest segment for full attention (no query looks
  further back). A run that fits in one block is one dense masked call ("one call per pack").
* ``causal``: a document longer than ``LONG`` on a layer that sees all of it (full
  attention, or not longer than the window) alone, ``is_causal`` and no mask: it would widen
  the band of its run to its own length. (Longer than the window, it is a band alone.)

Every call has 4-D inputs, so torch runs its fused CPU flash kernel, which keeps the
logsumexp for backward and no score matrix (3-D inputs would take the math path). What the
pieces keep for backward, on top of that fused kernel's own (``cpu_sdpa_extra_bytes`` in
``core/costs/activations.py`` books the same): a band's padded copies of q, k and v
(``blocks * block`` queries, ``width - 1`` more keys) and its additive mask
``[blocks, 1, block, block + width - 1]`` in the activation dtype, which is built once per
micro-batch, window and dtype (in ``layout.cache``, so every layer of a type shares one
tensor). Memory is O(block x keys a block sees) per query block, never O(T^2).

Padding (positions after a document's real tokens) attends within its own segment and comes
out as zeros (``torch.where``, so it passes no gradient); no real token ever sees it, as
padding follows every real token of its document and attention is causal.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

# A document longer than this gets its own causal call on a full-width layer, so that the band
# of its run stays narrow. fwd + bwd, 1 thread, full attention (``bench_attention.py``): T=1024
# (7 documents, longest 243, 4 x 16 heads) 3.1 ms at 16-64, 3.6 at 128, 5.5 at 256, 4.7 ms one
# call per document; T=4096 (9, longest 1105, 8 x 32) 97-99 ms at 64-256; window 512 100 ms
# at 64-256, 120 above.
LONG = 64


class Piece(NamedTuple):
    start: int  # buffer offsets [start, stop) of whole padded segments
    stop: int
    kind: str   # "band" or "causal"
    width: int  # keys a query can see, counting itself (band)
    block: int  # queries per block (band); the piece's length when it is one block


def block_size(width: int) -> int:
    """Queries per block: the key span ``block + width - 1`` wastes ``block - 1`` keys per
    query, while smaller blocks add per-block work. fwd + bwd, 1 thread, T=1024, window 8,
    6 x 16 heads (``benchmarks/bench_attention.py --blocks``): 3.7 ms at 8, 2.6 at 16, 2.5 at
    32, 3.1 at 64, 4.6 at 128 (26 ms one call per document and window block); window 512
    (T=4096, 8 x 32 heads): 97-101 ms at 32-64, 109 at 128."""
    return 32 if width <= 64 else 64


def _band(start: int, stop: int, width: int) -> Piece:
    n, block = stop - start, block_size(width)
    if n <= block + width - 1:  # one dense masked block costs n*n <= n*(block + width - 1)
        return Piece(start, stop, "band", min(width, n), n)
    return Piece(start, stop, "band", width, block)


def plan_pieces(starts: list, total: int, window: int | None) -> list[Piece]:
    """Cut the pack (padded segments at ``starts``, ending at ``total``) into pieces."""
    pieces, run, longest = [], None, 0
    for s, e in zip(starts, list(starts[1:]) + [total]):
        if e - s > LONG and (window is None or window > LONG):
            if run is not None:
                pieces.append(_band(run, s, min(window or longest, longest)))
            run, longest = None, 0
            whole = window is None or e - s <= window
            pieces.append(Piece(s, e, "causal", e - s, e - s) if whole else _band(s, e, window))
        elif e > s:
            run = s if run is None else run
            longest = max(longest, e - s)
    if run is not None:
        pieces.append(_band(run, total, min(window or longest, longest)))
    return pieces


def _lookback(p: Piece) -> int:
    """Keys before a block's first query that it may see (none when the piece is one block)."""
    return 0 if p.block == p.stop - p.start else p.width - 1


def band_mask(p: Piece, doc_T: torch.Tensor, window: int | None, dtype) -> torch.Tensor:
    """Additive mask ``[blocks, 1, block, block + lookback]`` of a band piece, from the
    document index of every position (a device tensor; nothing is read back)."""
    n, B, P = p.stop - p.start, p.block, _lookback(p)
    nb, dev = -(-n // B), doc_T.device
    q = torch.arange(nb * B, device=dev).view(nb, B, 1)                     # query, from start
    k = (torch.arange(nb, device=dev) * B).view(nb, 1, 1) + torch.arange(B + P, device=dev) - P
    doc = doc_T[p.start:p.stop]
    same = doc[q.clamp(max=n - 1)] == doc[k.clamp(0, n - 1)]
    keep = same & (k >= 0) & (k <= q) & (q < n)
    if window is not None:
        keep &= q - k < window
    keep |= k == q  # the block's padding rows (past the piece) see themselves: no empty row
    return torch.zeros(keep.shape, dtype=dtype, device=dev).masked_fill_(~keep, float("-inf"))[:, None]


def _band_attention(q, k, v, p: Piece, mask, scale: float, gqa: bool) -> torch.Tensor:
    n, B, P = p.stop - p.start, p.block, _lookback(p)
    nb = -(-n // B)
    tail = nb * B - n
    # [n, H, D] -> [blocks, H, block, D]: a view of the padded copy
    q_ = F.pad(q[p.start:p.stop], (0, 0, 0, 0, 0, tail)).view(nb, B, q.shape[1], q.shape[2]).transpose(1, 2)
    # keys: overlapping windows of the padded copy (unfold: a view, its backward a sum)
    k_, v_ = (F.pad(t[p.start:p.stop], (0, 0, 0, 0, P, tail)).unfold(0, B + P, B).permute(0, 1, 3, 2)
              for t in (k, v))
    o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2).reshape(nb * B, q.shape[1], v.shape[2])[:n]  # v's head dim may differ


def _causal_attention(q, k, v, p: Piece, scale: float, gqa: bool) -> torch.Tensor:
    q_, k_, v_ = (t[p.start:p.stop].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, n, D]
    o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _prepared(layout, window: int | None, device, dtype):
    """The pieces, their masks and the real-token mask (None: no padding) of this micro-batch,
    built once and shared by every layer with this window (and by recompute)."""
    key = ("sdpa", window, device, dtype)
    if key not in layout.cache:
        pieces = plan_pieces(layout.starts, layout.total, window)
        doc = layout.doc_ids(device) if any(p.kind == "band" for p in pieces) else None
        masks = [band_mask(p, doc, window, dtype) if p.kind == "band" else None for p in pieces]
        padded = sum(layout.lengths) < layout.total
        valid = layout.valid_mask(device)[:, None, None] if padded else None
        layout.cache[key] = (pieces, masks, valid)
    return layout.cache[key]


def sdpa_attention(q, k, v, layout, window: int | None, scale: float) -> torch.Tensor:
    """Exact causal THD attention (``window``: keys a query sees, counting itself; None: all
    of its document); ``q``/``k [T, H, D]``, ``v [T, Hkv, Dv]`` (``Dv`` may differ from ``D``),
    out ``[T, Hq, Dv]``; zeros on padding."""
    if layout.part_of is not None:
        return _part_attention(q, k, v, layout, window, scale)
    pieces, masks, valid = _prepared(layout, window, q.device, q.dtype)
    gqa = q.shape[1] != k.shape[1]
    outs = [_band_attention(q, k, v, p, m, scale, gqa) if p.kind == "band" else
            _causal_attention(q, k, v, p, scale, gqa) for p, m in zip(pieces, masks)]
    o = outs[0] if len(outs) == 1 else torch.cat(outs)
    return o if valid is None else torch.where(valid, o, 0.0)


def _part_attention(q, k, v, layout, window: int | None, scale: float) -> torch.Tensor:
    """Attention of a chunk of whole documents (``layout.part_of``: the whole layout and the
    chunk's offset) as the whole's pieces compute it, so that a chunk's rows equal the unchunked
    layer's bitwise (the MoE overlap's chunks): its q, k and v placed at their offset among
    zeros, the whole's pieces that hold any of its rows run with the whole's masks, its rows
    kept. The other chunk's keys a block sees are masked for this chunk's queries (another
    document), so their zeros add exact zeros; pieces wholly outside the chunk are skipped, a
    band piece across the cut is run whole (up to one piece of extra work per chunk)."""
    whole, a = layout.part_of.whole, layout.part_of.offset
    n, T = q.shape[0], whole.total
    q, k, v = (F.pad(t, (0, 0, 0, 0, a, T - a - n)) for t in (q, k, v))
    pieces, masks, valid = _prepared(whole, window, q.device, q.dtype)
    gqa = q.shape[1] != k.shape[1]
    outs = [q.new_zeros(p.stop - p.start, q.shape[1], v.shape[2]) if p.stop <= a or p.start >= a + n else
            _band_attention(q, k, v, p, m, scale, gqa) if p.kind == "band" else
            _causal_attention(q, k, v, p, scale, gqa) for p, m in zip(pieces, masks)]
    o = (outs[0] if len(outs) == 1 else torch.cat(outs))[a:a + n]
    return o if valid is None else torch.where(valid[a:a + n], o, 0.0)
