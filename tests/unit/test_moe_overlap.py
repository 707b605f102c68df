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
from tests.host_reads import HostReads
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
    with HostReads() as reads:  # a GPU sync each: only the split sizes, one per chunk and layer
        o = over(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
    forward = list(record.events)
    # what --optimizer-in-backward reads: each parameter's post-accumulate hook runs once, on its
    # final gradient (a joined weight's first chunk adds none, core/moe/joined_grads.py)
    seen_by_hook: dict = {}
    for p in over.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen_by_hook.setdefault(id(p), []).append(p.grad.clone()))
    with reads:  # ... and none in the backward (the joined weight gradients read nothing)
        (o.loss_sum + 0.3 * sum(o.mtp_loss_sums) + 0.01 * o.aux_loss).backward()
    assert [w for w, _ in reads.reads] == ["tolist"] * 2 * len(over.moe_layers()), reads.reads
    assert all("host_values.py" in where for _, where in reads.reads), reads.reads
    assert all(len(seen_by_hook[id(p)]) == 1 and torch.equal(seen_by_hook[id(p)][0], p.grad) for p in over.parameters())
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


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_a_weight_both_chunks_use_gets_the_one_gemm_gradient_bitwise():
    """--bf16: a plain linear (with bias), a LoRA linear's fp32 adapters, both RMSNorm forms on 3-D
    input (q_norm's) and the routed experts (grouped GEMM and the loop) run a chunk at a time under JoinedWeightGrads give
    the weight gradients of one run over all tokens bitwise (not two rounded sums), and the
    input gradients too. The experts' rows: chunk c's grouped by (expert, source), the plain
    run's by (expert, source, chunk). Outside the context the modules are as they were."""
    from core.moe.experts import GroupedExperts
    from core.moe.joined_grads import JoinedWeightGrads
    from core.transformer.norm import RMSNorm

    from core.finetune.lora import LoRALinear

    T, cut = 40, 17
    mods = torch.nn.ModuleDict({"linear": torch.nn.Linear(16, 24), "norm": RMSNorm(8),
                                "norm1": RMSNorm(8, offset=False),
                                "lora": LoRALinear(torch.nn.Linear(16, 24, bias=False), 4, 8.0)}).bfloat16()
    for i, p in enumerate(mods.parameters()):
        p.data.copy_(_bf16(*p.shape, seed=10 + i))
    mods["lora"].weight.requires_grad_(False)  # a frozen bf16 base, fp32 adapters
    for n in ("lora_A", "lora_B"):
        setattr(mods["lora"], n, torch.nn.Parameter(getattr(mods["lora"], n).float()))
    cases = [(mods[n], _bf16(T, 16), _bf16(T, 24, seed=1)) for n in ("linear", "lora")] + \
        [(mods[n], _bf16(T, 2, 8, seed=2), _bf16(T, 2, 8, seed=3)) for n in ("norm", "norm1")]
    for m, x, g in cases:
        trained = [p for p in m.parameters() if p.requires_grad]
        x0 = x.clone().requires_grad_()
        y = m(x0)
        if isinstance(m, RMSNorm):  # the plain forward, split in two methods, is the formula as it was
            xf = x.float()
            ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + m.eps)
            ref = (ref * (1.0 + m.weight.float())).type_as(x) if m.offset else m.weight * ref.to(x.dtype)
            assert torch.equal(y, ref)
        y.backward(g)
        plain = [p.grad.clone() for p in trained]
        m.zero_grad(set_to_none=True)
        join, x1 = JoinedWeightGrads(mods), x.clone().requires_grad_()
        outs = []
        for part in x1.split([cut, T - cut]):
            with join.chunk():
                outs.append(m(part))
        torch.autograd.backward(outs, list(g.split([cut, T - cut])))
        assert all(torch.equal(a, p.grad) for a, p in zip(plain, trained)), m
        assert torch.equal(x0.grad, x1.grad), m
        assert not {"forward", "adapter"} & set(m.__dict__)

    # experts: 3 local experts, rows from 2 source ranks, chunk c's block (e, s) of n[c, s, e] rows
    n = torch.tensor([[[2, 0, 3], [1, 4, 0]], [[3, 1, 0], [2, 0, 5]]])
    blocks = {(c, s, e): _bf16(int(n[c, s, e]), 16, seed=100 + 9 * c + 3 * s + e)
              for c in range(2) for s in range(2) for e in range(3)}
    grads = {k: _bf16(v.shape[0], 16, seed=200 + i) for i, (k, v) in enumerate(blocks.items())}
    for grouped in (True, False):
        ex = GroupedExperts(3, 16, 8).bfloat16()
        ex.use_grouped_mm = grouped
        for i, p in enumerate(ex.parameters()):
            p.data.copy_(_bf16(*p.shape, seed=30 + i) / 4)
        whole = [(c, s, e) for e in range(3) for s in range(2) for c in range(2)]
        x0 = torch.cat([blocks[k] for k in whole]).requires_grad_()
        ex(x0, n.sum((0, 1))).backward(torch.cat([grads[k] for k in whole]))
        plain = [p.grad.clone() for p in ex.parameters()]
        ex.zero_grad(set_to_none=True)
        join, xs, outs, gs = JoinedWeightGrads(torch.nn.ModuleList([ex])), [], [], []
        for c in range(2):
            own = [(c, s, e) for e in range(3) for s in range(2)]
            xs.append(torch.cat([blocks[k] for k in own]).requires_grad_())
            with join.chunk(n[c]):
                outs.append(ex(xs[c], n[c].sum(0)))
            gs.append(torch.cat([grads[k] for k in own]))
        torch.autograd.backward(outs, gs)
        assert all(torch.equal(a, p.grad) for a, p in zip(plain, ex.parameters())), grouped
        rows = {k: r for k, r in zip(whole, x0.grad.split([int(n[k]) for k in whole]))}
        for c in range(2):
            own = [(c, s, e) for e in range(3) for s in range(2)]
            assert torch.equal(xs[c].grad, torch.cat([rows[k] for k in own])), grouped
        assert "project" not in ex.__dict__


@pytest.mark.parametrize("window", [None, 8])
def test_a_chunks_sdpa_attention_is_the_whole_packs_rows_bitwise(window):
    """The overlap's chunk layouts (``part_of``) take their rows from the whole pack's sdpa
    pieces: bf16 outputs and gradients equal the unchunked call's bitwise (a chunk's own pieces
    block its documents otherwise, other bf16 roundings). Documents of 12, 70 (a causal piece of
    its own on a full-width layer), 9, 30 and 7 tokens, cut at 82 (A: 2, B: 3 documents)."""
    from core.moe.overlap import _chunks
    from core.transformer.sdpa_blocks import sdpa_attention

    layout = _layout([0, 12, 82, 91, 121, 128])
    parts = _chunks(layout)
    assert [(a, b) for a, b, _ in parts] == [(0, 82), (82, 128)]
    q, k, v = (_bf16(128, 4, 8, seed=s) for s in range(3))
    g = _bf16(128, 4, 8, seed=3)
    q0, k0, v0 = (t.clone().requires_grad_() for t in (q, k, v))
    whole = sdpa_attention(q0, k0, v0, layout, window, 0.35)
    whole.backward(g)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    outs = [sdpa_attention(q1[a:b], k1[a:b], v1[a:b], sub, window, 0.35) for a, b, sub in parts]
    torch.autograd.backward(outs, [g[a:b] for a, b, _ in parts])
    assert torch.equal(torch.cat(outs), whole)
    assert all(torch.equal(x.grad, y.grad) for x, y in ((q0, q1), (k0, k1), (v0, v1)))
