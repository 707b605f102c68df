"""The test-tree family (tests/fake_family.py) with core's multi-head latent attention: a family
choosing MLA touches no file outside tests/. In process: it resolves by preset, each document of
a pack gets the logits it gets alone, and two pipeline stages built apart (same seed) give the
whole model's loss and gradients, as the e2e run (tests/e2e/test_fake_family.py) checks for
PP2 x DP2 with the GQA variant."""
from __future__ import annotations

import torch

from core.loss import IGNORE_INDEX
from core.transformer.mla import MLAttention
from models import registry
from tests.fake_family import FakeDenseModel
from tests.unit.numerics import assert_close_rel
from tests.unit.test_model_hf import thd

LENGTHS = [6, 11, 3]


def _model(**kw) -> FakeDenseModel:
    spec, cfg = registry.resolve("fake-mla-tiny")
    return spec.model_class(cfg, **kw)


def _labels(tokens, psp):
    T = tokens.numel()
    ends = torch.isin(torch.arange(1, T + 1), psp.cu_seqlens[1:].long())
    return torch.where(ends, IGNORE_INDEX, torch.cat([tokens[1:], tokens[:1]]))


def test_mla_variant_runs_each_document_as_alone():
    model = _model(seed=0)
    assert all(isinstance(b.self_attn, MLAttention) for b in model.layers.values())
    tokens, pos, psp = thd(LENGTHS, seed=1)
    with torch.no_grad():
        packed = model(tokens, pos, psp)
        for s, n in zip(psp.cu_seqlens.tolist(), LENGTHS):
            one_tokens, one_pos, one_psp = tokens[s:s + n], pos[s:s + n], thd([n])[2]
            assert_close_rel(packed[s:s + n], model(one_tokens, one_pos, one_psp), rel=1e-6)


def test_mla_variant_split_in_two_stages_equals_the_whole_model():
    whole = _model(seed=0)
    first = _model(layers=[0, 1], first=True, last=False, seed=0)
    last = _model(layers=[2, 3], first=False, last=True, seed=0)
    params = dict(whole.named_parameters())
    for stage in (first, last):  # the seeding contract: the same weights in any layout
        assert all(torch.equal(p, params[n]) for n, p in stage.named_parameters())
    tokens, pos, psp = thd(LENGTHS, seed=2)
    labels = _labels(tokens, psp)
    ref = whole(tokens, pos, psp, labels=labels)
    ref.loss_sum.backward()
    hidden = first(tokens, pos, psp, labels=labels).hidden
    sent = hidden.detach().requires_grad_()
    out = last(tokens, pos, psp, hidden=sent, labels=labels)
    out.loss_sum.backward()
    hidden.backward(sent.grad)
    loss, want = float(out.loss_sum.detach()), float(ref.loss_sum.detach())
    assert torch.isfinite(out.loss_sum) and abs(loss - want) <= 1e-6 * want
    for stage in (first, last):
        for n, p in stage.named_parameters():
            assert p.grad is not None and p.grad.abs().max() > 0, n
            assert_close_rel(p.grad, params[n].grad, rel=1e-5)


def test_mla_variant_is_costed_by_cores_shape():
    """The family's costs name core's MLAShape and nothing else: the weights a token multiplies
    through equal the built model's matrices (the embedding a lookup, the head counted)."""
    from core.costs.flops import matmul_params_per_token
    from core.costs.shapes import MLAShape

    spec, cfg = registry.resolve("fake-mla-tiny")
    shapes = registry.shapes_of(cfg)
    assert all(isinstance(b.attention, MLAShape) for b in shapes.blocks)
    model = spec.model_class(cfg, seed=0)
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    assert matmul_params_per_token(shapes) == weights
