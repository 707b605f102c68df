"""``--recompute-chunks`` and ``--offload-recompute-inputs`` (core/transformer/chunked.py): a fully
recomputed block run a token chunk at a time gives the unchunked block's losses, MoE statistics
and gradients (within fp32 rounding: the gradients sum over chunks in another order), and the
chunks are cut where documents end."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from core.finetune.lora import LoraSettings, apply_lora
from core.optim.in_backward import InBackwardSteps
from core.transformer.attention_backends import DocLayout
from core.transformer.block import apply_recompute
from core.transformer.chunked import PendingGrads, chunk_cuts
from tests.unit.hf_reference import randomize
from tests.unit.test_head_loss import _step37
from tests.unit.test_model_hf import thd
from tests.unit.test_model_thd import labels_for

LENGTHS = [9, 3, 12, 1, 11, 12, 20, 4]  # T = 72, documents ending at 24, 36 and 48: 2 or 3 chunks


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


def _lora37(recompute: str, chunks: int = 1):
    """Tiny Step-3.7 with MoE MTP depths under LoRA: a frozen base (the embedding too, so no
    block input needs a gradient), adapters everywhere, every weight random (B too); chunked
    with its inputs offloaded (the same Function)."""
    model = _step37(mtp_mlp_layer_types=["sparse", "sparse"])
    apply_lora(model, LoraSettings(lora_rank=2, lora_alpha=4.0, lora_targets="attention,mlp,shared_expert,experts"))
    randomize(model, 1)
    apply_recompute(model, recompute, chunks=chunks, offload_inputs=chunks > 1)
    return model


def test_lora_adapters_train_through_chunked_blocks():
    """A chunked block's adapters are used inside its autograd Function, not passed in; with a
    frozen embedding no input of the first block needs a gradient, and the loss needed none
    (nothing trained). Every adapter's gradient equals the unchunked recompute's and no
    recompute's (the tolerance of the test above) and is not zero; the base gets none."""
    models = [_lora37("full"), _lora37("none"), _lora37("full", 2)]
    (ref_losses, _, ref), (_, _, plain), (losses, _, grads) = map(_step, models)
    assert torch.allclose(losses, ref_losses, rtol=1e-5)
    adapters = {n for n, p in models[0].named_parameters() if p.requires_grad}
    assert adapters and ref.keys() == plain.keys() == grads.keys() == adapters
    for n in adapters:
        scale = ref[n].abs().max()
        assert scale > 0, n
        assert (grads[n] - ref[n]).abs().max() <= 1e-5 * scale and (plain[n] - ref[n]).abs().max() <= 1e-5 * scale, n


def test_a_stage_whose_output_reaches_no_trainable_parameter_is_an_error(monkeypatch):
    """The guard that would have caught it: the trainer's step (one process, the last stage)
    stops at the forward instead of skipping the backward of a loss that needs no gradient."""
    import core.transformer.chunked
    from core.parallel_state import ParallelSizes, ParallelState
    from core.train_step import StepSettings, train_step
    from data.thd import THDBatch

    monkeypatch.setattr(core.transformer.chunked, "_anchor", lambda block, tensors: ())  # the defect
    model = _lora37("full", 2)
    tokens, pos, psp = thd(LENGTHS, seed=3)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    with pytest.raises(RuntimeError, match=r"pipeline stage 0: the output needs no gradient but reaches \d+ "
                                           "trainable parameters, so nothing would train; .*--recompute-chunks"):
        train_step([model], ParallelState(ParallelSizes(1), 0, {}), opt,
                   [THDBatch(tokens, labels_for(tokens, LENGTHS), pos, psp)],
                   StepSettings(hidden_size=model.config.hidden_size, mtp_depths=2))


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
    assert chunk_cuts(DocLayout.from_params(thd(LENGTHS, seed=3)[2]), 2) == [0, 36, 72]
    assert seen == [(9, 3, 12, 1, 11), (12, 20, 4)] * 2


S = 16  # tokens per pack in the properties below


@st.composite
def packs(draw):
    """A micro-batch of 1-6 packs of S tokens, each split into documents at random."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        ends = sorted(draw(st.sets(st.integers(1, S - 1), max_size=5))) + [S]
        out.append([b - a for a, b in zip([0] + ends, ends)])
    return out


@settings(max_examples=60, deadline=None)
@given(packs(), st.integers(1, 6))
def test_every_rank_cuts_n_chunks_of_whole_packs_or_is_told_why(micro_batch, n):
    """The same n equal chunks whatever the documents (ranks exchange tokens inside a block):
    groups of whole packs when n divides the packs (what the flags enforce); otherwise equal
    cuts that happen to end documents, or a refusal naming the flag."""
    lengths = [d for pack in micro_batch for d in pack]
    layout = DocLayout.from_params(thd(lengths, seed=0)[2])
    T, ends = layout.total, {sum(lengths[:i]) for i in range(len(lengths) + 1)}
    equal = [k * T // n for k in range(n + 1)]
    if len(micro_batch) % n == 0:
        assert chunk_cuts(layout, n) == [k * len(micro_batch) // n * S for k in range(n + 1)]
    elif T % n == 0 and set(equal) <= ends:
        assert chunk_cuts(layout, n) == equal
    else:
        with pytest.raises(ValueError, match=f"--recompute-chunks {n}: a micro-batch of {T} tokens"):
            chunk_cuts(layout, n)


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
    steps.muon, steps.active, steps.stream, steps.held, steps.pending = Muon(), True, None, {}, PendingGrads()
    steps._stepped = lambda p, kept: None
    p.register_post_accumulate_grad_hook(steps._hook(Muon.param_groups[0], counted=False))
    steps.pending.set(p, True)
    (p * 2).sum().backward()
    steps.pending.set(p, False)
    (p * 3).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((2, 2), 5.0))


def test_chunks_need_full_recompute():
    with pytest.raises(ValueError, match="--recompute-chunks and --offload-recompute-inputs need "
                                         "--recompute-granularity full"):
        apply_recompute(_step37(), "selective", chunks=2)


def _flash_h100(**kw):
    from tests.planner_inputs import inputs
    base = dict(ep=8, dp=8, data_parallel_sharding="fsdp", cpu_offload="masters", optimizer_in_backward=True,
                recompute_granularity="full", seq_length=8192, micro_batch_size=4, num_microbatches=1, bf16=True, device_gb=80)
    return inputs(**{**base, **kw})


def test_the_planner_counts_one_chunk_and_the_offloaded_inputs():
    """Step-3.7-Flash, EP8 x DP8, 4 packs per rank: a pack at a time holds a quarter of the
    recompute working set and all-to-all buffers and adds one block's fp32 gradient sums;
    offloading moves every recomputed block's kept input but the two in flight to the host."""
    from models.registry import spec
    from training.planner.memory import GB, MASTER, _plain_blocks, placement, plan
    from training.planner.shares import ROOT, rank_shares

    cfg = spec("step37").config_class.preset("step37-flash")
    whole, chunked, off = (plan(cfg, _flash_h100(**kw))[0] for kw in
                           ({}, {"recompute_chunks": 4}, {"recompute_chunks": 4, "offload_recompute_inputs": True}))
    for col in ("recompute working set", "all-to-all buffers"):
        assert abs(chunked.device[col] * 4 - whole.device[col]) <= 4 * GB // 1000, col
    # host masters at one micro-batch leave the experts out of FSDP (expert-DP 1): their fp32 sums
    # are the chunked block's extra bytes (FSDP's units accumulate as over micro-batches)
    share = rank_shares(cfg, 1, 1, 8, None, 8192)[0][0]
    experts = max(n for k, n in _plain_blocks(share, placement(_flash_h100())).items() if k is not ROOT)
    assert experts == 36 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    # the sum (4 bytes) where the block's bf16 gradient (2) was, and one expert stack's bf16 gradient
    stack = 36 * cfg.hidden_size * cfg.moe_intermediate_size
    assert chunked.device["unsharded grads"] - whole.device["unsharded grads"] == experts * (MASTER - 2) + stack * 2
    one = 4 * 8192 * cfg.hidden_size * 2  # a block's kept input: T x H in bf16
    moved = (cfg.num_layers + 2 * cfg.num_mtp_layers - 2) * one
    assert off.host["activations"] == moved and chunked.device["activations"] - off.device["activations"] == moved


def test_the_planner_frees_the_root_after_the_heads_only_with_one_stage_per_rank():
    """FSDP frees the root's weights (embedding, final norm, head) once the heads' backward is
    done when one stage runs per rank (core/distributed/fsdp.py): the planner then holds them
    only where the forward is the peak; under a pipeline or gather-once they stay counted."""
    from dataclasses import replace

    from models.registry import spec
    from training.planner.memory import plan

    cfg = spec("step37").config_class.preset("step37-flash")
    root = (cfg.vocab_size * cfg.hidden_size * 2 + cfg.hidden_size) * 2  # embedding, head, norm in bf16
    one = _flash_h100()
    r = plan(cfg, one)[0]
    kept = plan(cfg, replace(one, mode=replace(one.mode, fsdp_gather_once=True)))[0]
    # held through the forward with one block, not beside the decoder layers' backward (their
    # working sets and gradients outweigh it): the column is a block's backward, less than the root
    assert r.device["gathered layers"] < root
    assert kept.device["gathered layers"] > r.device["gathered layers"]
    piped = plan(cfg, replace(one, pp=2, ep=4, dp=4))  # PP2: a later micro-batch's forward may hold them
    assert all(x.device["gathered layers"] >= root for x in piped if x.pp_rank == 1)


def test_each_chunked_block_prefetches_its_inner_units_then_the_block_before():
    """The backward prefetch order ``apply_fsdp`` sets (``core/distributed/fsdp.py``): FSDP's own
    order would point inside a block run in chunks (its inner units record N forwards), so each
    such block prefetches its router and experts (its first chunk's rerun needs them) and then the
    block before it. The tiny Step-3.7: a dense layer 0, MoE layers 1-3, two dense MTP depths."""
    from core.distributed.fsdp import backward_prefetch_order

    model = _step37()
    apply_recompute(model, "full", chunks=2)
    units = {id(u.module) for u in model.fsdp_units()}
    name = {id(m): n for n, m in model.named_modules()}
    order = {name[id(b)]: [name[id(t)] for t in targets]
             for b, targets in backward_prefetch_order(model, lambda m: id(m) in units)}
    assert order == {
        "layers.0": [],
        "layers.1": ["layers.1.moe.router", "layers.1.moe.experts", "layers.0"],
        "layers.2": ["layers.2.moe.router", "layers.2.moe.experts", "layers.1"],
        "layers.3": ["layers.3.moe.router", "layers.3.moe.experts", "layers.2"],
        "mtp.0": ["layers.3"],
        "mtp.1": ["mtp.0"],
    }
    apply_recompute(model, "full")  # unchunked blocks keep FSDP's own order
    assert backward_prefetch_order(model, lambda m: id(m) in units) == []
    apply_recompute(model, "full", num_layers=2, chunks=2)  # only the chunked ones (the first two layers)
    assert [name[id(b)] for b, _ in backward_prefetch_order(model, lambda m: id(m) in units)] == \
        ["layers.0", "layers.1"]


def test_one_offload_stream_per_device_made_once(monkeypatch):
    """``ChunkedRecompute.offload_stream`` (CUDA only; faked here): one high-priority stream per
    device index, made on first use and returned to every block after."""
    from core.transformer.chunked import ChunkedRecompute

    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority=0: made.append((device, priority)) or object())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    shared = ChunkedRecompute()
    first = shared.offload_stream(torch.device("cuda", 0))
    assert all(shared.offload_stream(torch.device("cuda", 0)) is first for _ in range(45))  # 45 blocks, one stream
    assert shared.offload_stream(torch.device("cuda")) is shared.offload_stream(torch.device("cuda", 1)) is not first
    assert made == [(torch.device("cuda", 0), -1), (torch.device("cuda", 1), -1)]


def test_the_in_backward_step_takes_each_chunked_matrix_once_with_its_whole_gradient():
    """``pending_grads(chunks)`` handed to ``InBackwardSteps``, as the trainer does: blocks run 2
    chunks at a time without FSDP (autograd calls a matrix's hooks once per chunk), and each Muon
    matrix steps once, on its gradient summed over both chunks: bit for bit what the same
    backward leaves without the optimizer (the same sums, in the same order)."""
    from types import SimpleNamespace

    from core.model_api import specs_of
    from core.optim.build import build_optimizer
    from core.parallel_state import ParallelState
    from core.transformer.block import pending_grads

    model, ref_model = _step37(), _step37()
    for m in (model, ref_model):
        apply_recompute(m, "full", chunks=2)
    _, _, ref = _step(ref_model)
    opt, _ = build_optimizer([model], SimpleNamespace(
        optimizer="muon", lr=0.02, adamw_lr=None, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        muon_momentum=0.0, muon_nesterov=True, muon_ns_steps=5, muon_ns_method="quintic", muon_lr_adjust="rms",
        muon_ns_dtype="fp32", dion_momentum=0.9, dion_rank_fraction=0.5))
    muon, name, seen = opt.optimizers["muon"], {id(p): n for n, p in model.named_parameters()}, {}
    muon.update = lambda p, group, guard: seen.setdefault(name[id(p)], []).append(p.grad.clone()) or torch.tensor(True)
    steps = InBackwardSteps(muon, specs_of([model]), ParallelState.single(), pending_grads([model]))
    steps.begin()
    _step(model)
    steps.end()
    matrices = {name[id(p)] for p in steps.params}
    assert matrices and seen.keys() == matrices
    assert all(len(g) == 1 and torch.equal(g[0], ref[n]) for n, g in seen.items())
