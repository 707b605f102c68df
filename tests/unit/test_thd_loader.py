"""THD micro-batches and the distributed, resumable loader."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from data.indexed_dataset import IndexedDatasetWriter, InMemoryDataset as ArrayDataset
from data.loader import THDLoader, blend_pattern, open_source, parse_data_path
from data.packing import plan_packs
from data.thd import IGNORE_INDEX, build_thd_batch

PAD = 999


def _docs(rng, n, max_len):
    # token value encodes (document, position) so labels can be checked exactly
    return [np.arange(L, dtype=np.int64) + 1000 * (d + 1) for d, L in enumerate(rng.integers(1, max_len, n))]


def test_hand_worked_layout():
    docs = [np.array([1, 2, 3, 4, 5]), np.array([6, 7, 8, 9, 10, 11])]
    segs = np.array([[0, 0, 5], [1, 0, 6]])
    b = build_thd_batch([segs], ArrayDataset(docs), 16, PAD, pad_multiple=4)
    assert b.tokens.tolist() == [1, 2, 3, 4, 5, PAD, PAD, PAD, 6, 7, 8, 9, 10, 11, PAD, PAD]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]
    assert b.labels.tolist() == [2, 3, 4, 5] + [-100] * 4 + [7, 8, 9, 10, 11] + [-100] * 3
    p = b.packed_seq_params
    assert p.cu_seqlens.tolist() == [0, 5, 11] and p.cu_seqlens_padded.tolist() == [0, 8, 16]
    assert p.max_seqlen == 6 and p.cu_seqlens.dtype == torch.int32


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 3), st.sampled_from([1, 2, 4]), st.booleans())
def test_random_packs_obey_the_contract(seed, mbs, pad_multiple, with_mask):
    rng = np.random.default_rng(seed)
    S = 64
    docs = _docs(rng, 40, 90)
    masks = [rng.integers(0, 2, len(d)).astype(np.uint8) for d in docs]
    lengths = np.array([len(d) for d in docs])
    plan = plan_packs((lengths + pad_multiple - 1) // pad_multiple * pad_multiple, S, seed=seed)
    segs = [np.array(plan.pack(p)) for p in range(min(mbs, plan.num_packs))]
    for s in segs:  # real lengths (the plan was made on padded ones)
        s[:, 2] = np.minimum(s[:, 1] + s[:, 2], lengths[s[:, 0]]) - s[:, 1]
    b = build_thd_batch(segs, ArrayDataset(docs), S, PAD,
                        loss_mask=ArrayDataset(masks) if with_mask else None, pad_multiple=pad_multiple)
    T = len(segs) * S
    tok, lab, pos = b.tokens.numpy(), b.labels.numpy(), b.position_ids.numpy()
    p = b.packed_seq_params
    assert tok.shape == lab.shape == pos.shape == (T,) and int(p.cu_seqlens_padded[-1]) == T
    all_segs = np.concatenate(segs)
    assert (np.diff(p.cu_seqlens.numpy()) == all_segs[:, 2]).all()
    assert p.max_seqlen == int(all_segs[:, 2].max())
    starts = p.cu_seqlens_padded.numpy()
    for i, (d, s, n) in enumerate(all_segs.tolist()):
        a, e = starts[i], starts[i + 1]
        assert (tok[a:a + n] == docs[d][s:s + n]).all() and (tok[a + n:e] == PAD).all()
        assert (pos[a:e] == np.arange(e - a)).all()  # restart at 0 per document
        assert (lab[a + n - 1:e] == IGNORE_INDEX).all()  # last token and padding: no target
        for j in range(n - 1):  # next token of the same document, or masked
            want = docs[d][s + j + 1]
            if with_mask and not masks[d][s + j + 1]:
                want = IGNORE_INDEX
            assert lab[a + j] == want


def test_pack_too_full_after_padding_is_an_error():
    with pytest.raises(ValueError, match="plan packs with padded lengths"):
        build_thd_batch([np.array([[0, 0, 5], [1, 0, 5]])], ArrayDataset([np.arange(5)] * 2), 10, 0,
                        pad_multiple=4)


def _dataset(tmp_path, name, docs, masks=None):
    prefix = str(tmp_path / f"{name}_text_document")
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d in docs:
            w.add(d)
    if masks is not None:
        with IndexedDatasetWriter(str(tmp_path / f"{name}_loss_mask_document"), np.uint8) as w:
            for m in masks:
                w.add(m)
    return prefix


def _loader(srcs, **kw):
    kw.setdefault("seq_length", 128)
    kw.setdefault("micro_batch_size", 2)
    return THDLoader(srcs, pad_id=PAD, **kw)


def _pack_ids(batch):
    """Identify packs by their token content (each doc's tokens are unique)."""
    t = batch.tokens.numpy()
    return {tuple(t[i:i + 128].tolist()) for i in range(0, len(t), 128)}


def test_dp_ranks_never_share_a_pack_and_resume_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    prefix = _dataset(tmp_path, "a", _docs(rng, 300, 200))
    src = open_source(prefix, 128, "split", seed=5)
    ranks = [_loader([(1.0, src)], dp_rank=r, dp_size=2, seed=5) for r in range(2)]
    seen = [set().union(*(_pack_ids(next(l)) for _ in range(20))) for l in ranks]
    assert not seen[0] & seen[1]
    # interrupted at micro-batch 7, restored into a fresh loader: identical continuation
    full = _loader([(1.0, src)], dp_rank=1, dp_size=2, seed=5)
    expected = [next(full) for _ in range(15)]
    part = _loader([(1.0, src)], dp_rank=1, dp_size=2, seed=5)
    for _ in range(7):
        next(part)
    state = part.state_dict()
    resumed = _loader([(1.0, open_source(prefix, 128, "split", seed=5))], dp_rank=1, dp_size=2, seed=5)
    resumed.load_state_dict(state)
    for want in expected[7:]:
        got = next(resumed)
        for f in ("tokens", "labels", "position_ids"):
            assert torch.equal(getattr(got, f), getattr(want, f))
    with pytest.raises(ValueError, match="--seed 5 -> 6"):
        _loader([(1.0, src)], dp_rank=1, dp_size=2, seed=6).load_state_dict(state)
    # another DP size resumes at the same global position: 7 per rank x 2 ranks = 14 on one rank
    single = _loader([(1.0, src)], seed=5)
    single.load_state_dict(state)
    assert single.consumed == 14
    with pytest.raises(ValueError, match="not a multiple of --micro-batch-size x data-parallel size = 8"):
        _loader([(1.0, src)], dp_rank=0, dp_size=4, seed=5).load_state_dict({**state, "global_packs": 28})


def _rewrite(prefix, docs):
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d in docs:
            w.add(d)


@pytest.mark.parametrize("equal_lengths", [False, True])
def test_resume_on_the_same_documents_in_another_order_is_refused_naming_the_dataset(tmp_path, equal_lengths):
    """The same rows preprocessed again in another order into the same prefix: the old
    fingerprint (prefix, token and document counts, pack count) matched, and the resumed run
    trained on other packs without a word. The lengths in order catch it; with every document of
    one length, the sampled tokens do. --ignore-data-fingerprint keeps the position on purpose."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 1000, 40) for _ in range(200)] if equal_lengths else _docs(rng, 200, 150)
    prefix = _dataset(tmp_path, "r", docs)
    first = _loader([(1.0, open_source(prefix, 128, "split", seed=5))], seed=5)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    order = rng.permutation(len(docs))
    _rewrite(prefix, [docs[i] for i in order])
    again = _loader([(1.0, open_source(prefix, 128, "split", seed=5))], seed=5)
    with pytest.raises(ValueError, match=f"--data-path {prefix}: its documents are not the "
                                         "checkpoint's.*--ignore-data-fingerprint"):
        again.load_state_dict(state)
    ignored = again.load_state_dict(state, ignore_fingerprint=True)
    assert len(ignored) == 1 and prefix in ignored[0] and again.consumed == 3
    _rewrite(prefix, docs)  # the original order back: the state fits again
    back = _loader([(1.0, open_source(prefix, 128, "split", seed=5))], seed=5)
    assert back.load_state_dict(state) == [] and back.consumed == 3


def test_resume_with_another_micro_batch_size_or_a_moved_dataset_continues_with_the_same_packs(tmp_path):
    """The state counts packs, not micro-batches, and no path: 3 micro-batches of 2 packs resume
    as 6 of 1 (docs/checkpoints.md: batch flags may change on a resume), and a copy of the dataset
    in another directory resumes like the original."""
    rng = np.random.default_rng(4)
    prefix = _dataset(tmp_path, "m", _docs(rng, 300, 150))
    two = _loader([(1.0, open_source(prefix, 128, "split", seed=5))], seed=5, micro_batch_size=2)
    for _ in range(3):
        next(two)
    state = two.state_dict()
    expected = set().union(*(_pack_ids(next(two)) for _ in range(4)))  # packs 6..13
    (tmp_path / "moved").mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(prefix + ext, tmp_path / "moved" / f"m_text_document{ext}")
    moved = str(tmp_path / "moved" / "m_text_document")
    one = _loader([(1.0, open_source(moved, 128, "split", seed=5))], seed=5, micro_batch_size=1)
    assert one.load_state_dict(state) == [] and one.consumed == 6
    assert set().union(*(_pack_ids(next(one)) for _ in range(8))) == expected


def test_a_state_of_the_previous_version_resumes_when_its_sizes_match(tmp_path):
    """Version 1 counted micro-batches and fingerprinted sizes and counts only (its formula is
    kept to read such checkpoints): for the same data it resumes, for another --seq-length it is
    refused."""
    rng = np.random.default_rng(5)
    src = open_source(_dataset(tmp_path, "v", _docs(rng, 100, 150)), 128, "split", seed=5)
    old = {"global_consumed": 3, "fingerprint": _loader([(1.0, src)], seed=5)._legacy_fingerprint()}
    resumed = _loader([(1.0, src)], seed=5)
    assert resumed.load_state_dict(old) == [] and resumed.consumed == 3
    with pytest.raises(ValueError, match="a checkpoint of an older version"):
        _loader([(1.0, src)], seed=5, seq_length=256).load_state_dict(old)


def test_epochs_reshuffle_and_cover_every_pack(tmp_path):
    rng = np.random.default_rng(1)
    src = open_source(_dataset(tmp_path, "e", _docs(rng, 100, 150)), 128, "split", seed=0)
    P = src.plan.num_packs
    ld = _loader([(1.0, src)], micro_batch_size=1)
    epoch0 = [ld.global_pack(k)[1].tobytes() for k in range(P)]
    epoch1 = [ld.global_pack(k)[1].tobytes() for k in range(P, 2 * P)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def test_blending_follows_weights(tmp_path):
    rng = np.random.default_rng(2)
    a = open_source(_dataset(tmp_path, "a", _docs(rng, 50, 100)), 128, "split", seed=0)
    b = open_source(_dataset(tmp_path, "b", _docs(rng, 50, 100)), 128, "split", seed=0)
    ld = _loader([(0.7, a), (0.3, b)], micro_batch_size=1)
    picks = [ld.global_pack(k)[0] for k in range(1000)]
    assert picks.count(0) == 700
    pattern = blend_pattern([0.7, 0.3], period=100)
    assert all(abs((pattern[:n] == 0).sum() - 0.7 * n) < 1 for n in range(1, 101))
    next(ld)  # a mixed micro-batch builds too
    mixed = _loader([(0.5, a), (0.5, b)], micro_batch_size=2)
    batch = next(mixed)
    assert int(batch.packed_seq_params.cu_seqlens_padded[-1]) == 256


def test_parse_data_path():
    assert parse_data_path(["A"]) == [(1.0, "A")]
    assert parse_data_path(["0.7", "A", "0.3", "B"]) == [(0.7, "A"), (0.3, "B")]
    with pytest.raises(ValueError, match="weight-prefix pairs"):
        parse_data_path(["0.7", "A", "B"])
    with pytest.raises(ValueError, match="'x' is not a weight"):
        parse_data_path(["x", "A"])
    for bad in ("nan", "inf", "-inf", "0", "-0.5"):  # nan used to pass: it fails every comparison
        with pytest.raises(ValueError, match=f"weight '{bad}' for A must be a finite number > 0"):
            parse_data_path([bad, "A", "1", "B"])


def test_bad_documents_are_skipped_counted_and_reported(tmp_path):
    docs = [np.arange(10), np.zeros(0, np.int64), np.arange(7), np.arange(5)]
    masks = [np.ones(10, np.uint8), np.zeros(0, np.uint8), np.ones(3, np.uint8), np.ones(5, np.uint8)]
    prefix = _dataset(tmp_path, "chat", docs, masks)
    with pytest.warns(UserWarning) as rec:
        src = open_source(prefix, 32, "split", seed=0)
    text = " ".join(str(w.message) for w in rec)
    assert "1 document(s) (empty): ids [1]" in text and "(mask_length_mismatch): ids [2]" in text
    assert src.skipped == {"empty": 1, "mask_length_mismatch": 1}
    assert sorted(src.plan.segments[:, 0].tolist()) == [0, 3]
