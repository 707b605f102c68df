"""THD: a pack of documents gives each document the logits and gradients it gets alone."""
from __future__ import annotations

import pytest
import torch

from core.packed_seq import PackedSeqParams
from models.step37 import Step37Config, Step37Model
from tests.unit.hf_reference import randomize
from tests.unit.numerics import assert_close_rel
from tests.unit.test_model_hf import thd

LENGTHS = [9, 3, 14, 1, 11]  # window 8: three documents exceed it


def tiny(backend="sdpa", seed=0):
    model = Step37Model(Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), attention_backend=backend))
    randomize(model, seed)
    return model


def labels_for(tokens, lengths):
    labels = torch.full_like(tokens, -100)
    s = 0
    for n in lengths:
        labels[s:s + n - 1] = tokens[s + 1:s + n]
        s += n
    return labels


def _loss(out):
    # main + MTP token losses; the router aux loss is a batch statistic and is left out
    return out.loss_sum + sum(out.mtp_loss_sums)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_logits_equal_each_document_alone(backend):
    model = tiny(backend)
    tokens, pos, psp = thd(LENGTHS, seed=4)
    with torch.no_grad():
        packed = model(tokens, pos, psp)
        s = 0
        for n in LENGTHS:
            t, p, q = thd([n])
            alone = model(tokens[s:s + n], p, q)
            # fp32, the pack's GEMMs and attention reduce in another order than one document's:
            # measured <= 2.3e-6 relative (logits up to ~10) over 10 model/token seeds, sdpa and
            # flex alike; 2e-5 leaves ~9x margin
            assert_close_rel(packed[s:s + n], alone, rel=2e-5)
            s += n


def test_flex_forward_equals_sdpa():
    tokens, pos, psp = thd(LENGTHS, seed=2)
    with torch.no_grad():
        # fp32, two attention kernels summing in different orders: measured <= 1.3e-6 relative
        # over 10 model/token seeds; 1e-5 leaves ~8x margin
        assert_close_rel(tiny("flex")(tokens, pos, psp), tiny("sdpa")(tokens, pos, psp), rel=1e-5)


def test_packed_gradients_equal_sum_of_documents_alone():
    """Loss of the pack = sum of the documents' losses, so gradients add up exactly the same
    (MTP shifts stay inside each document, or this would fail)."""
    model = tiny(seed=1)
    tokens, pos, psp = thd(LENGTHS, seed=5)
    out = model(tokens, pos, psp, labels=labels_for(tokens, LENGTHS))
    _loss(out).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    s, count, mtp_counts = 0, 0, [0, 0]
    for n in LENGTHS:
        t = tokens[s:s + n]
        _, p, q = thd([n])
        o = model(t, p, q, labels=labels_for(t, [n]))
        _loss(o).backward()
        count += int(o.num_tokens)
        mtp_counts = [a + int(b) for a, b in zip(mtp_counts, o.mtp_num_tokens)]
        s += n
    assert count == int(out.num_tokens) == sum(n - 1 for n in LENGTHS)
    assert mtp_counts == [int(c) for c in out.mtp_num_tokens] == \
        [sum(max(n - 1 - k, 0) for n in LENGTHS) for k in (1, 2)]
    # per tensor, relative to its largest entry (they range ~0.1 to ~10). fp32, one backward over
    # the pack vs five accumulated ones: measured <= 4.7e-6 relative over 10 model/token seeds;
    # 5e-5 leaves ~10x margin
    for name, p in model.named_parameters():
        assert_close_rel(packed[name], p.grad, rel=5e-5)


def test_padding_and_padded_offsets_do_not_change_real_tokens():
    """cu_seqlens_padded with per-document padding (pad_multiple 4) and a folded trailing pad."""
    model = tiny(seed=3)
    lengths = [5, 7]
    tokens, pos, psp = thd(lengths, seed=6)
    T = 16
    padded_tokens = torch.zeros(T, dtype=torch.long)
    padded_pos = torch.cat([torch.arange(8), torch.arange(8)])
    padded_tokens[0:5], padded_tokens[8:15] = tokens[:5], tokens[5:]
    params = PackedSeqParams(torch.tensor([0, 5, 12], dtype=torch.int32),
                             torch.tensor([0, 8, 16], dtype=torch.int32), 7)
    with torch.no_grad():
        a = model(padded_tokens, padded_pos, params)
        b = model(tokens, pos, psp)
    # fp32, padded vs unpadded shapes change the GEMM/attention reduction order: measured
    # <= 7.6e-7 relative over 10 model/token seeds; 1e-5 leaves ~13x margin
    assert_close_rel(a[0:5], b[:5], rel=1e-5)
    assert_close_rel(a[8:15], b[5:], rel=1e-5)


def test_mtp_targets_are_shifted_within_documents():
    model = tiny(seed=7)
    tokens, pos, psp = thd([4, 6], seed=8)
    out = model(tokens, pos, psp, labels=labels_for(tokens, [4, 6]))
    # depth k predicts t + k + 1: a document of n tokens has n - 1 - k targets at depth k
    assert [int(c) for c in out.mtp_num_tokens] == [(4 - 2) + (6 - 2), (4 - 3) + (6 - 3)]
