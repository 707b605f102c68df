"""Context-parallel sharding of THD micro-batches (``core/context_parallel/shard.py``,
``data/cp_shard.py``): the hand-worked layout, and shard-then-unshard giving back tokens, labels,
positions and the MTP depths' inputs and targets exactly, for odd lengths, documents shorter than
2N and one document filling the pack."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from core.context_parallel.shard import check_divisible, mtp_shifts, owners, shard_positions, unshard
from core.transformer.attention_backends import DocLayout
from core.transformer.mtp import next_in_document as _next_in_document
from data.cp_shard import shard_batch
from data.indexed_dataset import InMemoryDataset
from data.thd import IGNORE_INDEX, build_thd_batch

PAD = 999


def _batch(lengths, S, pad_multiple, mbs=1):
    docs = [np.arange(n, dtype=np.int64) + 1000 * (d + 1) for d, n in enumerate(lengths)]
    packs, i = [], 0
    for _ in range(mbs):  # consecutive documents, as many as fit each pack once padded
        segs, used = [], 0
        while i < len(docs) and used + -(-len(docs[i]) // pad_multiple) * pad_multiple <= S:
            segs.append([i, 0, len(docs[i])])
            used += -(-len(docs[i]) // pad_multiple) * pad_multiple
            i += 1
        if segs:
            packs.append(np.array(segs, dtype=np.int64))
    return build_thd_batch(packs, InMemoryDataset(docs), S, PAD, pad_multiple=pad_multiple)


def test_hand_worked_layout():
    """N = 2, documents of 7 and 3 tokens padded to 8 and 4 (the module docstring's picture)."""
    b = _batch([7, 3], 12, 4)
    assert shard_positions(b.packed_seq_params.cu_seqlens_padded.tolist(), 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert shard_positions(b.packed_seq_params.cu_seqlens_padded.tolist(), 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    r0, r1 = (shard_batch(b, 2, r, mtp_depths=1) for r in (0, 1))
    assert r0.tokens.tolist() == [1000, 1001, 1006, PAD, 2000, PAD]
    assert r0.labels.tolist() == [1001, 1002, -100, -100, 2001, -100]
    assert r0.position_ids.tolist() == [0, 1, 6, 7, 0, 3]
    assert r0.packed_seq_params.cu_seqlens_padded.tolist() == [0, 4, 6]
    assert r0.packed_seq_params.cu_seqlens.tolist() == [0, 3, 4]  # real tokens held: 3 of doc 0, 1 of doc 1
    assert r0.packed_seq_params.cp.valid.tolist() == [True, True, True, False, True, False]
    # MTP depth 1 at position t: token t + 2 of the same document (the model rolls twice)
    assert r0.packed_seq_params.cp.mtp_inputs.tolist() == [[1001, 1002, 0, 0, 2001, 0]]
    assert r0.packed_seq_params.cp.mtp_labels.tolist() == [[1002, 1003, -100, -100, 2002, -100]]
    assert r1.tokens.tolist() == [1002, 1003, 1004, 1005, 2001, 2002]


def _model_roll(b, depths):
    """The unsharded model's own MTP inputs and targets (models/step37/model.py)."""
    layout = DocLayout.from_params(b.packed_seq_params)
    nxt, ok = _next_in_document(layout, "cpu")
    tok, lab, ins, outs = b.tokens, b.labels, [], []
    for _ in range(depths):
        tok = torch.where(ok, tok[nxt], torch.zeros_like(tok))
        lab = torch.where(ok, lab[nxt], torch.full_like(lab, IGNORE_INDEX))
        ins.append(tok)
        outs.append(lab)
    return torch.stack(ins), torch.stack(outs)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 8]), st.lists(st.integers(1, 70), min_size=1, max_size=12),
       st.integers(1, 2), st.integers(0, 3))
def test_shard_then_unshard_gives_the_pack_back(N, lengths, mbs, depths):
    S = 16 * N * 4  # a multiple of 2N; documents up to 70 tokens: some shorter than 2N, odd lengths
    lengths = [min(n, S) for n in lengths]  # the planner never packs a document longer than a pack
    b = _batch(lengths, S, 2 * N, mbs)
    cu_pad = b.packed_seq_params.cu_seqlens_padded.tolist()
    shards = [shard_batch(b, N, r, depths) for r in range(N)]
    for name in ("tokens", "labels", "position_ids"):
        assert torch.equal(unshard([getattr(s, name) for s in shards], cu_pad, N), getattr(b, name)), name
    assert sum(int(s.num_target_tokens) for s in shards) == int(b.num_target_tokens)
    assert sum(int(s.packed_seq_params.cu_seqlens[-1]) for s in shards) == int(b.packed_seq_params.cu_seqlens[-1])
    assert all(s.tokens.numel() * N == b.tokens.numel() for s in shards)
    valid = unshard([s.packed_seq_params.cp.valid for s in shards], cu_pad, N)
    assert torch.equal(valid, DocLayout.from_params(b.packed_seq_params).valid_mask("cpu"))
    if depths:
        want_in, want_lab = _model_roll(b, depths)
        for name, want in (("mtp_inputs", want_in), ("mtp_labels", want_lab)):
            got = unshard([getattr(s.packed_seq_params.cp, name) for s in shards], cu_pad, N, dim=-1)
            assert torch.equal(got, want), name
    rank_of, local_of = owners(cu_pad, N)
    for r, s in enumerate(shards):  # every position held once, where owners() says
        assert (rank_of[s.packed_seq_params.cp.index] == r).all()
        assert (local_of[s.packed_seq_params.cp.index] == np.arange(s.tokens.numel())).all()


@pytest.mark.parametrize("N", [2, 4, 8])
def test_one_document_filling_the_pack(N):
    S = 2 * N * 5
    b = _batch([S], S, 2 * N)
    shards = [shard_batch(b, N, r, 2) for r in range(N)]
    assert [s.position_ids[:5].tolist() for s in shards][1] == list(range(5, 10))  # chunk 1 on rank 1
    assert shards[0].position_ids[5:].tolist() == list(range(S - 5, S))  # chunk 2N-1 on rank 0
    assert torch.equal(unshard([s.tokens for s in shards], b.packed_seq_params.cu_seqlens_padded.tolist(), N),
                       b.tokens)


def test_undivisible_padding_is_refused_naming_the_flag():
    b = _batch([5, 3], 12, 2)  # padded to 6 and 6: not multiples of 4
    with pytest.raises(ValueError, match=r"--context-parallel-size 2: document 0 has padded length 6, "
                                         r"not a multiple of 2 x 2; pack with --document-pad-multiple"):
        shard_batch(b, 2, 0)
    with pytest.raises(ValueError, match=r"CP rank 2 must be in \[0, 2\)"):
        shard_positions([0, 8], 2, 2)
    check_divisible([0, 8, 12], 2)


def test_mtp_shifts_stay_inside_documents():
    tokens = np.array([1, 2, 3, 0, 4, 5, 0, 0])
    labels = np.array([2, 3, -100, -100, 5, -100, -100, -100])
    ins, tgt = mtp_shifts(tokens, labels, [0, 3, 5], [0, 4, 8], 2)
    assert ins.tolist() == [[2, 3, 0, 0, 5, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 0]]
    assert tgt.tolist() == [[3, -100, -100, -100, -100, -100, -100, -100], [-100] * 8]


def test_the_validation_loader_gives_each_cp_rank_its_shard_of_the_same_batches(tmp_path):
    """training/eval_data.validation_loader at CP2: both CP ranks' micro-batches unshard to the
    CP1 loader's (same packs: both pad documents to 4) and their targets add up to its count."""
    from types import SimpleNamespace

    from core.parallel_state import ParallelSizes
    from data.indexed_dataset import IndexedDatasetWriter
    from train_args import parse
    from training.eval_data import validation_loader

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "v_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(40):
            w.add(rng.integers(0, 256, rng.integers(5, 60)))
    args = parse(["--data-path", prefix, "--model-preset", "tiny", "--seq-length", "128", "--split", "50,50,0",
                  "--document-pad-multiple", "4", "--data-cache-path", str(tmp_path)])

    def loader(cp, rank):
        ps = SimpleNamespace(sizes=ParallelSizes(cp, cp=cp), cp_rank=rank, dp_rank=0, is_first_stage=True)
        return validation_loader(args, PAD, ps, mtp_depths=1)

    whole, shards = loader(1, 0), [loader(2, r) for r in range(2)]
    for m in range(3):
        ref, parts = whole.micro_batch(m), [s.micro_batch(m) for s in shards]
        pad = ref.packed_seq_params.host_boundaries()[1]
        assert all(p.packed_seq_params.cp.rank == r for r, p in enumerate(parts))
        for name in ("tokens", "labels", "position_ids"):
            assert torch.equal(unshard([getattr(p, name) for p in parts], pad, 2), getattr(ref, name)), name
        assert sum(int(p.num_target_tokens) for p in parts) == int(ref.num_target_tokens)
