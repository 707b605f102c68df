"""The CPU ``sdpa`` backend (``core/transformer/sdpa_blocks.py``) against two references over
random document layouts: the per-document implementation it replaced (kept here verbatim,
one SDPA call per document and per window block) and a dense masked fp64 attention.

Tolerances, relative to the largest value compared: both sides are fp32 and sum the same
terms in other orders (the fused CPU flash kernel and its online softmax vs the math path),
so the difference is a few fp32 roundings of each dot product and softmax sum, measured
<= 1.5e-6 of the largest output and gradient over these examples; REL = 1e-5 leaves ~7x.
Against the fp64 reference the fp32 side's own rounding is all there is (same bound). Inputs
are N(0, 1), so every compared value's natural scale is ~1: a gradient that cancels exactly on
one side (a query with one key: the softmax has no slope, dq = 0 in exact arithmetic) is
compared at that scale, not at its own zero (``close``)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from core.packed_seq import PackedSeqParams
from core.transformer import sdpa_blocks
from core.transformer.attention_backends import DocLayout, sdpa_attention
from core.transformer.sdpa_blocks import Piece, plan_pieces
from tests.unit.numerics import assert_close_rel

REL = 1e-5


# ------------------------------------------------------------------ references
def _band_mask(q_start: int, nq: int, k_start: int, nk: int, window: int, device) -> torch.Tensor:
    d = (torch.arange(q_start, q_start + nq, device=device)[:, None]
         - torch.arange(k_start, k_start + nk, device=device)[None, :])
    return (d >= 0) & (d < window)


def per_document_sdpa(q, k, v, layout: DocLayout, window, scale):
    """The backend before sdpa_blocks (main at 9166cc8), unchanged."""
    out = torch.zeros_like(q)
    gqa = q.shape[1] != k.shape[1]
    for s, n in zip(layout.starts, layout.lengths):
        if n == 0:
            continue
        if window is None or n <= window:
            qd, kd, vd = (t[s:s + n].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale, enable_gqa=gqa)
            out[s:s + n] = o.transpose(0, 1)
            continue
        for qs in range(0, n, window):
            qe = min(qs + window, n)
            ks = max(0, qs - window + 1)
            qd, kd, vd = (t[s + a:s + b].transpose(0, 1) for t, a, b in
                          ((q, qs, qe), (k, ks, qe), (v, ks, qe)))
            o = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=_band_mask(qs, qe - qs, ks, qe - ks, window, q.device),
                scale=scale, enable_gqa=gqa)
            out[s + qs:s + qe] = o.transpose(0, 1)
    return out


def dense_reference(q, k, v, layout: DocLayout, window, scale):
    """One [T, T] fp64 softmax: same real document, causal, inside the window; zeros elsewhere."""
    T, group = layout.total, q.shape[1] // k.shape[1]
    doc = layout.doc_ids("cpu")
    valid = layout.valid_mask("cpu")
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    keep = (doc[:, None] == doc[None, :]) & (j <= i) & valid[None, :]
    if window is not None:
        keep &= i - j < window
    keep |= (i == j) & ~valid[:, None]  # padding rows see themselves (no empty softmax), then zeros
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    p = s.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.where(valid[:, None, None], torch.einsum("hqk,khd->qhd", p, vv), 0.0)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """``assert_close_rel`` against the larger of the reference's largest value and 1 (see top)."""
    one = torch.ones(1, dtype=torch.float64)
    assert_close_rel(torch.cat([a.double().flatten(), one]), torch.cat([b.double().flatten(), one]), rel=REL)


def layout_of(lengths: list, pads: list) -> DocLayout:
    cu, cu_pad = [0], [0]
    for n, p in zip(lengths, pads):
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + n + p)
    return DocLayout.from_params(PackedSeqParams(torch.tensor(cu, dtype=torch.int32),
                                                 torch.tensor(cu_pad, dtype=torch.int32), max(lengths)))


def _inputs(T, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, d, generator=g).requires_grad_() for h in (hq, hkv, hkv)] + \
        [torch.randn(T, hq, d, generator=g)]


def _run(fn, q, k, v, dy, layout, window, scale):
    for t in (q, k, v):
        t.grad = None
    o = fn(q, k, v, layout, window, scale)
    o.backward(dy)
    return [o.detach()] + [t.grad.clone() for t in (q, k, v)]


# ------------------------------------------------------------------ properties
layouts = st.lists(st.tuples(st.integers(0, 40), st.sampled_from([0, 0, 0, 1, 3])), min_size=1, max_size=9)


@settings(max_examples=60, deadline=None)
@given(docs=layouts, window=st.sampled_from([None, 1, 2, 5, 8, 13]), ratio=st.sampled_from([1, 2, 3]),
       long=st.sampled_from([4, 16, 64]), block=st.sampled_from([1, 4, 32]), seed=st.integers(0, 99))
def test_equals_the_per_document_backend_outputs_and_gradients(docs, window, ratio, long, block, seed):
    """Any layout (empty documents, padding after real tokens and at the tail), window, GQA
    ratio, and blocking (``long`` and ``block`` shrunk so that small packs take every path:
    several blocks, long documents alone, band pieces between them)."""
    lengths, pads = [n for n, _ in docs], [p for _, p in docs]
    if sum(lengths) == 0:  # a pack holds at least one real token
        lengths[0] = 1
    layout = layout_of(lengths, pads)
    q, k, v, dy = _inputs(layout.total, 2 * ratio, 2, 8, seed)
    want = _run(per_document_sdpa, q, k, v, dy, layout, window, 0.4)
    with mock.patch.object(sdpa_blocks, "LONG", long), \
            mock.patch.object(sdpa_blocks, "block_size", lambda width: block):
        got = _run(sdpa_attention, q, k, v, dy, layout, window, 0.4)
    valid = layout.valid_mask("cpu")
    assert torch.equal(got[0][~valid], torch.zeros_like(got[0][~valid]))  # padding: zeros, as before
    for a, b in zip(got, want):  # output, dq, dk, dv
        close(a, b)


@settings(max_examples=30, deadline=None)
@given(docs=layouts, window=st.sampled_from([None, 3, 8]), ratio=st.sampled_from([1, 3]), seed=st.integers(0, 99))
def test_equals_a_dense_fp64_reference(docs, window, ratio, seed):
    lengths, pads = [n for n, _ in docs], [p for _, p in docs]
    if sum(lengths) == 0:  # a pack holds at least one real token
        lengths[0] = 1
    layout = layout_of(lengths, pads)
    q, k, v, dy = _inputs(layout.total, 2 * ratio, 2, 8, seed)
    got = sdpa_attention(q, k, v, layout, window, 0.4)
    want = dense_reference(q, k, v, layout, window, 0.4)
    close(got, want)
    # gradients: of <dy, o> against the same scalar of the fp64 reference, per input
    (got * dy).sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    (dense_reference(qd, kd, vd, layout, window, 0.4) * dy.double()).sum().backward()
    for a, b in ((q, qd), (k, kd), (v, vd)):
        close(a.grad, b.grad)


def test_long_packs_at_the_default_sizes():
    """The default block sizes and LONG on a pack with long documents (full and window 512),
    one empty document and tail padding, against the per-document backend."""
    layout = layout_of([700, 3, 0, 300, 40, 260, 1], [0, 1, 0, 0, 0, 0, 20])
    q, k, v, dy = _inputs(layout.total, 4, 2, 16, 0)
    for window in (None, 8, 512):
        want = _run(per_document_sdpa, q, k, v, dy, layout, window, 0.25)
        got = _run(sdpa_attention, q, k, v, dy, layout, window, 0.25)
        for a, b in zip(got, want):
            close(a, b)


@pytest.mark.parametrize("lengths, window", [([4096], None), ([4096], 8), ([30] * 136 + [16], None)])
def test_what_autograd_keeps_is_linear_in_the_pack(lengths, window):
    """4096 tokens as one document (full: one causal call; window 8: one band) or as 137 short
    ones (one band of width 30): what backward keeps is q, k, v, output and logsumexp (3.1 MiB
    here), padded copies and a mask of T x (block + width - 1) entries (measured 3.1-4.0 MiB
    in all; 6 MiB allowed), never the T x T x heads scores of one call over the pack (256 MiB)."""
    from core.costs.saved_bytes import SavedTensorBytes

    layout = layout_of(lengths, [0] * len(lengths))
    q, k, v, _ = _inputs(4096, 4, 2, 16, 0)
    with SavedTensorBytes() as saved:
        sdpa_attention(q * 1, k * 1, v * 1, layout, window, 0.25)  # * 1: leaves are not counted
    q_bytes = q.numel() * 4
    assert saved.bytes <= 6 * q_bytes, saved.bytes / q_bytes


# ------------------------------------------------------------------ the plan and its calls
def test_plan_cuts_long_documents_out_of_full_width_layers():
    # segments (padded): 10, 300, 0, 20, 5 (= 335 tokens); LONG 64, blocks of 32 (width <= 64)
    starts, T = [0, 10, 310, 310, 330], 335
    # full attention: the 300-token document alone and causal; the short runs one dense
    # block each (10 tokens; 20 + 5 = 25 tokens, width 20)
    assert plan_pieces(starts, T, None) == [Piece(0, 10, "band", 10, 10), Piece(10, 310, "causal", 300, 300),
                                            Piece(310, 335, "band", 20, 25)]
    # window 8: one band over the whole pack, blocks of 32 against 32 + 7 keys
    assert plan_pieces(starts, T, 8) == [Piece(0, 335, "band", 8, 32)]
    # window 280 (> LONG): the long document alone, banded by the window
    # (300 <= 64 + 279 keys: one dense block)
    assert plan_pieces(starts, T, 280)[1] == Piece(10, 310, "band", 280, 300)


def test_a_tiny_model_step_makes_few_calls_and_one_mask_per_window(monkeypatch):
    """The tiny model (4 layers, 2 MTP depths, two layer types) on a 256-token pack of 12
    documents: each attention is one SDPA call (the old backend made ~190 per forward), and
    the two masks (one per window) are built once for forward, backward and every layer."""
    from models.step37 import Step37Config, Step37Model
    from tests.unit.test_model_hf import thd
    from tests.unit.test_model_thd import labels_for

    calls, masks = [], []
    sdpa, mask = F.scaled_dot_product_attention, sdpa_blocks.band_mask
    monkeypatch.setattr(sdpa_blocks.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    monkeypatch.setattr(sdpa_blocks, "band_mask", lambda *a, **k: masks.append(1) or mask(*a, **k))
    cfg = Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), attention_backend="sdpa")
    lengths = [30, 5, 17, 40, 9, 33, 12, 25, 21, 38, 2, 24]
    tokens, pos, psp = thd(lengths)
    out = Step37Model(cfg)(tokens, pos, psp, labels=labels_for(tokens, lengths))
    (out.loss_sum + sum(out.mtp_loss_sums)).backward()
    assert len(calls) == len(cfg.layer_types) + len(cfg.mtp_layer_types) == 6
    assert len(masks) == 2
