"""What context parallelism adds per attention layer and micro-batch, for the planner
(``training/planner/memory.py``, ``training/planner/timing.py``): the key buffer autograd keeps and the
bytes each rank receives, from what ``attention.py`` and ``exchange.py`` allocate and send.

Counted for the case a CP layout is chosen for: one document filling the pack of ``T`` tokens
(``N = cp``, chunks of ``c = T / 2N``), bytes ``b`` per element. What one token or key row
weighs is the attention shape's (``core/costs/shapes.py``): GQA moves and keeps K and V together
(``[rows, 2 Hkv, D]``); MLA moves its normed latent and roped key (``kv_lora_rank + qk_rope`` per
token), keeps the key buffer's latent rows with the K/V ``kv_b_proj`` expands them to, and runs
that expansion on the key buffer's rows instead of its own tokens (:func:`expand_flops`). Packs of many short documents move and keep less on full layers (each
chunk reads only its own document's prefix) and at most as much on sliding ones per document.
At ``cp == 1`` everything here is 0 (the unsharded attention path).
"""
from __future__ import annotations


def kv_row_bytes(a, b: int) -> int:
    """One key row of the kept buffer (GQA: one token's K and V, ``2 Hkv D b``)."""
    return a.key_row_bytes(b)


def halo_rows(T: int, cp: int, window: int) -> int:
    """The busiest rank's halo: ``min(w - 1, r c) + min(w - 1, (2N - 1 - r) c)`` keys before
    its two chunks (``2 (w - 1)`` once chunks are as long as the window)."""
    c = T // (2 * cp)
    return max(min(window - 1, r * c) + min(window - 1, (2 * cp - 1 - r) * c) for r in range(cp))


def key_rows(a, T: int, cp: int) -> int:
    """Rows of the key buffer one rank's attention call reads and autograd keeps for its
    backward (a tensor of its own: the gathered pool indexed by the host plan). Full layers: the
    prefixes of the rank's two chunks, ``(r + 1) c + (2N - r) c = (1 + 1/2N) T`` for every r;
    sliding layers: the rank's ``T / N`` rows and its halo."""
    if cp == 1:
        return 0
    if a.window is None:
        return T + T // (2 * cp)
    return T // cp + halo_rows(T, cp, a.window)


def key_buffer_bytes(a, T: int, cp: int, b: int) -> int:
    """Bytes of the key buffer kept per layer and micro-batch (not kept when the layer is
    recomputed: the recompute gathers again)."""
    return key_rows(a, T, cp) * kv_row_bytes(a, b)


def gathered_bytes(a, T: int, cp: int, b: int) -> int:
    """The all-gathered pool (K/V; MLA: latents) of a full layer (``T`` rows), alive only while the key buffer
    is cut from it: a transient of the layer's forward."""
    return T * a.exchange_row_bytes(b) if cp > 1 and a.window is None else 0


def exchange_bytes(a, T: int, cp: int, b: int) -> int:
    """Bytes a rank receives per pass of one layer: the all-gather's ``(N - 1) / N T`` rows
    (full; the backward's reduce-scatter of dK/dV moves as many) or at most its halo (sliding;
    the backward sends the halo's gradients back)."""
    if cp == 1:
        return 0
    rows = T * (cp - 1) // cp if a.window is None else halo_rows(T, cp, a.window)
    return rows * a.exchange_row_bytes(b)


def expand_flops(a, T: int, cp: int) -> float:
    """Forward FLOPs a rank spends per layer and micro-batch turning its key buffer into K/V
    beyond what its own ``T / N`` tokens cost in the per-token model (``core/costs/flops.py``): MLA's
    ``kv_b_proj`` runs on the ``key_rows`` rows (``(1 + 1/2N) T`` on a full layer) instead of
    ``T / N``; 0 for GQA, whose K/V move as they are."""
    if cp == 1:
        return 0.0
    return float(a.expand_flops(key_rows(a, T, cp)) - a.expand_flops(T // cp))
