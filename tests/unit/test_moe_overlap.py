"""The phased MoE layer and its overlapped two-chunk schedule (core/moe/overlap.py), on a one-rank
gloo group: the all-to-all dispatcher's every phase runs (an all-to-all with one rank), so the
numbers, the issue order of the collectives and the backward's interleaving are those of any EP
size; tests/distributed/parallel_cases.py checks EP2 and PP2 x EP2 against the plain schedule."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from core.distributed.collectives import CommRecord
from core.moe.dispatch import AllToAllDispatcher
from core.moe.overlap import apply_moe_overlap, split_point
from core.packed_seq import PackedSeqParams
from core.transformer.attention_backends import DocLayout
from tests.distributed.parallel_cases import micro_batches, tiny_config
from models import registry


@pytest.fixture(scope="module")
def group():
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if own:
        dist.destroy_process_group()


def _layout(bounds: list[int]) -> DocLayout:
    cu = torch.tensor(bounds, dtype=torch.int32)
    return DocLayout.from_params(PackedSeqParams(cu, cu, max(b - a for a, b in zip(bounds, bounds[1:])), "thd",
                                                 tuple(bounds), tuple(bounds)))


def test_the_cut_is_the_document_start_nearest_the_middle():
    assert split_point(_layout([0, 10, 30, 48])) == 30   # |30 - 24| = 6 < |10 - 24| = 14
    assert split_point(_layout([0, 12, 36, 48])) == 12   # a tie: the first
    assert split_point(_layout([0, 48])) == 48           # one document: B is empty


def _model(group, record=None, overlap=False):
    cfg = tiny_config()
    model = registry.spec_of(cfg).build(cfg, seed=0)
    for i, m in enumerate(model.moe_layers()):
        m.dispatcher = AllToAllDispatcher(group, 1, cfg.num_experts)
        m.dispatcher.record, m.dispatcher.tag = record, f"L{i}."
    if overlap:
        assert apply_moe_overlap(model) == len(model.moe_layers())
    return model


def _loss(model, b):
    out = model(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
    (out.loss_sum + 0.3 * sum(out.mtp_loss_sums) + 0.01 * out.aux_loss).backward()
    return out


def test_overlapped_schedule_gives_the_plain_numbers_and_hides_the_backwards_all_to_alls(group):
    """Loss, aux loss, expert load and every gradient (MTP depth included) equal the plain
    schedule's: fp32 sums over two chunks in another order (1e-6 relative; measured ~1e-7).
    And the backward's order as autograd runs it (recorded, not assumed): between the issue of a
    chunk's gradient all-to-all and its wait, the other chunk's all-to-all is issued (B's
    combine), its expert backward runs (A's combine, B's dispatch) or its dispatch's wait and
    attention (A's dispatch), in every MoE layer. Without the start / wait pair in the backward
    each gradient all-to-all is waited as soon as it is issued. (A one-document pack, B empty:
    tests/distributed/overlap_cases.py.)"""
    record = CommRecord()
    plain, over = _model(group), _model(group, record, overlap=True)
    seen = {}

    def mark(m, args, out):
        tag = next(d.dispatcher.tag for d in over.moe_layers() if d.experts is m)
        chunk = "AB"[seen.setdefault(tag, 0) % 2]
        seen[tag] += 1
        out.register_hook(lambda g: record.events.append((f"{tag}{chunk}", "experts.grad")))

    for layer in over.moe_layers():
        layer.experts.register_forward_hook(mark)
    b = micro_batches(1, 1, tiny_config().vocab_size)[0][0]
    a = _loss(plain, b)
    o = over(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
    forward = list(record.events)
    (o.loss_sum + 0.3 * sum(o.mtp_loss_sums) + 0.01 * o.aux_loss).backward()
    for x, y in ((a.loss_sum, o.loss_sum), (a.aux_loss, o.aux_loss)):
        x, y = float(x.detach()), float(y.detach())
        assert abs(x - y) <= 1e-6 * abs(x), (x, y)
    assert torch.equal(a.expert_load, o.expert_load)  # whole token counts: exact
    for (name, p), q in zip(plain.named_parameters(), over.parameters()):
        err = float((p.grad - q.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30))
        assert err <= 1e-6, f"{name}: {err:.2e}"

    backward = record.events[len(forward):]
    assert [w for _, w in forward[:4]] == ["counts", "start", "counts", "start"]  # both dispatches in flight
    at = {e: i for i, e in enumerate(backward)}
    for i in range(len(over.moe_layers())):
        L = f"L{i}."
        for flight, meanwhile in ((f"{L}B.combine", (f"{L}A.combine", "grad.start")),  # both in flight
                                  (f"{L}A.combine", (f"{L}B", "experts.grad")),
                                  (f"{L}B.dispatch", (f"{L}A", "experts.grad")),
                                  (f"{L}A.dispatch", (f"{L}B.dispatch", "grad.wait"))):
            assert at[(flight, "grad.start")] < at[meanwhile] < at[(flight, "grad.wait")], (flight, backward)
