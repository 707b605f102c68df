"""``--recompute-chunks`` and ``--offload-recompute-inputs`` (core/transformer/chunked.py): a fully
recomputed block run a token chunk at a time gives the unchunked block's losses, MoE statistics
and gradients (within fp32 rounding: the gradients sum over chunks in another order), and the
chunks are cut where documents end."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from core.optim.in_backward import InBackwardSteps
from core.transformer.attention_backends import DocLayout
from core.transformer.block import apply_recompute
from core.transformer.chunked import PENDING, chunk_cuts
from tests.unit.test_head_loss import _step37
from tests.unit.test_model_hf import thd
from tests.unit.test_model_thd import labels_for

LENGTHS = [9, 3, 14, 1, 11, 6, 20, 4]  # T = 68


def _step(model, lengths=LENGTHS, seed=3):
    """Forward and backward of the token losses plus the MoE auxiliary loss (so the routers'
    score sums carry a gradient): (losses, expert load, grads)."""
    tokens, pos, psp = thd(lengths, seed=seed)
    model.zero_grad()
    out = model(tokens, pos, psp, labels=labels_for(tokens, lengths))
    total = out.loss_sum + sum(out.mtp_loss_sums) + 0.1 * out.aux_loss
    total.backward()
    losses = torch.stack([out.loss_sum, *out.mtp_loss_sums, out.aux_loss]).detach()
    return losses, out.expert_load, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunks,offload", [(2, False), (3, True), (1, True)])
def test_chunked_recompute_gives_the_unchunked_losses_statistics_and_gradients(chunks, offload):
    """Tiny Step-3.7 with MoE MTP depths (both kinds of recomputed block, each with routing
    statistics), fp32 on CPU."""
    kw = dict(mtp_mlp_layer_types=["sparse", "sparse"])
    base, model = _step37(**kw), _step37(**kw)
    apply_recompute(base, "full")
    apply_recompute(model, "full", chunks=chunks, offload_inputs=offload)
    ref_losses, ref_load, ref = _step(base)
    losses, load, grads = _step(model)
    assert torch.equal(load, ref_load)  # counts: sums of integers
    # the forward's maths are the unchunked ones token by token (attention never crosses a
    # document), but the chunks' GEMMs have other shapes: fp32 rounding, measured <= 1e-7
    # relative; the gradients are sums over chunks in another order, measured <= 4e-6 of each
    # gradient's largest entry; 1e-5 leaves 2.5x
    assert ((losses - ref_losses).abs() <= 1e-5 * ref_losses.abs()).all(), (losses, ref_losses)
    assert grads.keys() == ref.keys()
    worst = {n: ((grads[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref}
    name = max(worst, key=worst.get)
    assert worst[name] <= 1e-5, (name, worst[name])


def test_a_chunk_rerun_is_really_chunked():
    """Each decoder layer's attention runs once per chunk in the forward and again in the
    backward, on chunks of whole documents."""
    model = _step37()
    apply_recompute(model, "full", chunks=2)
    seen = []
    layer = next(iter(model.layers.values()))
    forward = layer.self_attn.forward
    layer.self_attn.forward = lambda h, rope, layout: seen.append(tuple(layout.lengths)) or forward(h, rope, layout)
    _step(model)
    cut = chunk_cuts(DocLayout.from_params(thd(LENGTHS, seed=3)[2]), 2)
    assert cut == [0, 38, 68]  # 9 + 3 + 14 + 1 + 11 = 38 is the boundary nearest 34 (27 is 7 away)
    assert seen == [(9, 3, 14, 1, 11), (6, 20, 4)] * 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 6))
def test_chunks_are_cut_at_document_boundaries_and_cover_the_batch(lengths, n):
    layout = DocLayout.from_params(thd(lengths, seed=0)[2])
    cuts = chunk_cuts(layout, n)
    bounds = set(layout.starts) | {layout.total}
    assert cuts[0] == 0 and cuts[-1] == layout.total
    assert all(a < b for a, b in zip(cuts, cuts[1:])) and set(cuts) <= bounds
    assert len(cuts) - 1 <= min(n, len(lengths))


def test_equal_packs_are_cut_at_pack_boundaries():
    """Four packs of 16 tokens (documents never cross a pack): two chunks of two packs each."""
    lengths = [5, 11, 16, 7, 9, 3, 3, 10]
    assert chunk_cuts(DocLayout.from_params(thd(lengths, seed=0)[2]), 2) == [0, 32, 64]
    assert chunk_cuts(DocLayout.from_params(thd(lengths, seed=0)[2]), 4) == [0, 16, 32, 48, 64]


def test_in_backward_hooks_wait_for_the_last_chunk():
    """A parameter FSDP does not manage gets autograd's post-accumulate hook once per chunk: the
    in-backward step takes only the last one, the gradient summed over every chunk."""
    p = torch.nn.Parameter(torch.ones(2, 2))
    seen = []

    class Muon:
        split, param_groups = False, [{"params": [p]}]

        def update(self, p, group, guard):
            seen.append(p.grad.clone())
            return None

    steps = InBackwardSteps.__new__(InBackwardSteps)
    steps.muon, steps.active, steps.stream, steps.held = Muon(), True, None, {}
    steps._stepped = lambda p, kept: None
    p.register_post_accumulate_grad_hook(steps._hook(Muon.param_groups[0], counted=False))
    setattr(p, PENDING, True)
    (p * 2).sum().backward()
    setattr(p, PENDING, False)
    (p * 3).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((2, 2), 5.0))


def test_chunks_need_full_recompute():
    with pytest.raises(ValueError, match="--recompute-chunks and --offload-recompute-inputs need "
                                         "--recompute-granularity full"):
        apply_recompute(_step37(), "selective", chunks=2)


def _flash_h100(**kw):
    from training.memory_plan import PlanInputs
    base = dict(ep=8, dp=8, sharding="fsdp", cpu_offload="masters", optimizer_in_backward=True, recompute="full",
                seq_length=8192, micro_batch_size=4, num_microbatches=1, bf16=True, device_gb=80)
    return PlanInputs(**{**base, **kw})


def test_the_planner_counts_one_chunk_and_the_offloaded_inputs():
    """Step-3.7-Flash, EP8 x DP8, 4 packs per rank: a pack at a time holds a quarter of the
    recompute working set and all-to-all buffers and adds one block's fp32 gradient sums;
    offloading moves every recomputed block's kept input but the two in flight to the host."""
    from models.registry import spec
    from training.memory_plan import GB, plan, MASTER
    from training.plan_shares import ROOT, block_numel, rank_shares

    cfg = spec("step37").config_class.preset("step37-flash")
    whole, chunked, off = (plan(cfg, _flash_h100(**kw))[0] for kw in
                           ({}, {"recompute_chunks": 4}, {"recompute_chunks": 4, "offload_recompute_inputs": True}))
    for col in ("recompute working set", "all-to-all buffers"):
        assert abs(chunked.device[col] * 4 - whole.device[col]) <= 4 * GB // 1000, col
    share = rank_shares(cfg, 1, 1, 8, None, 8192)[0][0]
    largest = max(n for k, n in block_numel(share).items() if k is not ROOT)
    assert chunked.device["unsharded grads"] - whole.device["unsharded grads"] == largest * MASTER
    one = 4 * 8192 * cfg.hidden_size * 2  # a block's kept input: T x H in bf16
    moved = (cfg.num_layers + 2 * cfg.num_mtp_layers - 2) * one
    assert off.host["activations"] == moved and chunked.device["activations"] - off.device["activations"] == moved
