"""The models' heads on the chunked loss (core/loss.py): the training loss and every gradient
equal today's full-logits cross-entropy (Step-3.7's main head and MTP depths, Qwen3-MoE's tied
head); MTP depths recompute under --recompute-granularity with the same gradients, their MoE
statistics counted once."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import core.loss
import core.transformer.mtp
import models.common.decoder
from core.costs.activations import extra_block_bytes, head_bytes
from core.costs.saved_bytes import SavedTensorBytes
from core.transformer.block import apply_recompute
from models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel
from models.registry import shapes_of
from models.step37 import Step37Config, Step37Model
from tests.unit.hf_reference import randomize
from tests.unit.test_model_hf import thd
from tests.unit.test_model_thd import labels_for

LENGTHS = [9, 3, 14, 1, 11]


def _full_logits_loss(h, w, labels, **_):
    """Today's loss: fp32 logits of every token over the whole vocabulary."""
    loss = F.cross_entropy(F.linear(h, w).float(), labels, ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def _step37(seed=0, **overrides):
    model = Step37Model(Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), attention_backend="sdpa",
                                             **overrides))
    randomize(model, seed)
    return model


def _qwen_tied(seed=0):
    model = Qwen3MoeModel(Qwen3MoeConfig.from_hf(Qwen3MoeConfig.preset("qwen3-moe-tiny").to_hf(),
                                                 tie_word_embeddings=True))
    randomize(model, seed)
    return model


def _step(model, seed=3):
    """One forward and backward of the summed token losses: (losses, grads, output)."""
    tokens, pos, psp = thd(LENGTHS, seed=seed)
    model.zero_grad()
    out = model(tokens, pos, psp, labels=labels_for(tokens, LENGTHS))
    losses = torch.stack([out.loss_sum, *out.mtp_loss_sums]).detach()
    (out.loss_sum + sum(out.mtp_loss_sums)).backward()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, out


@pytest.mark.parametrize("build", [_step37, _qwen_tied], ids=["step37_mtp", "qwen3_moe_tied"])
def test_training_loss_and_gradients_equal_full_logits(build, monkeypatch):
    model = build()
    assert model.tied_head == (build is _qwen_tied)
    monkeypatch.setattr(core.loss, "TILE_BYTES", 4096)  # tiles of 8 tokens x 128 entries: T 38, vocab 320 split unevenly
    assert core.loss.tile_shape(38, 320, 64) == (8, 128)
    chunked, grads, out = _step(model)
    for module in (models.common.decoder, core.transformer.mtp):
        monkeypatch.setattr(module, "linear_cross_entropy", _full_logits_loss)
    full, ref, ref_out = _step(model)
    assert torch.equal(out.num_tokens, ref_out.num_tokens)
    assert [int(n) for n in out.mtp_num_tokens] == [int(n) for n in ref_out.mtp_num_tokens]
    # fp32: the tiles reorder the head's GEMM and logsumexp sums; measured <= 2.4e-7 relative
    # on the losses and <= 1.2e-6 of each gradient's largest entry (the embedding's included,
    # tied or feeding MTP); 1e-5 leaves ~8x
    assert ((chunked - full).abs() <= 1e-5 * full.abs()).all(), (chunked, full)
    assert set(grads) == set(ref)
    worst = {n: ((grads[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref}
    name = max(worst, key=worst.get)
    assert worst[name] <= 1e-5, (name, worst[name])


def test_inference_forward_still_returns_logits():
    model = _qwen_tied()
    tokens, pos, psp = thd(LENGTHS, seed=1)
    with torch.no_grad():
        logits = model(tokens, pos, psp)
        h = model.final_hidden(tokens, pos, psp)
    assert logits.shape == (sum(LENGTHS), model.config.vocab_size)
    assert torch.equal(logits, F.linear(h, model.embed_tokens.weight))


def test_the_head_keeps_what_the_planner_counts():
    """The final norm and the chunked loss save, in fp32, what ``core.costs.activations.head_bytes``
    counts byte for byte (the norm's input and normalised output, 1/rms, the head's input, the
    labels and the logsumexp), plus the norm's ``1 + w`` (a weight-sized tensor, not counted)."""
    model = _step37()
    tokens, pos, psp = thd(LENGTHS, seed=2)
    x = model._trunk(tokens, pos, psp, None)[0]
    labels = labels_for(tokens, LENGTHS)
    with SavedTensorBytes(model) as saved:
        core.loss.linear_cross_entropy(model.norm(x), model.head_weight, labels)
    H = model.config.hidden_size
    assert saved.bytes == head_bytes(shapes_of(model.config), tokens.numel(), 4) + H * 4


def _counting(module, counts, key):
    """Count ``module``'s forward calls (a forward hook would miss checkpoint's reruns)."""
    forward = module.forward

    def counted(*args, **kwargs):
        counts[key] = counts.get(key, 0) + 1
        return forward(*args, **kwargs)

    module.forward = counted


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_mtp_depths_recompute_with_the_same_gradients_and_statistics(granularity, monkeypatch):
    """MoE MTP depths (so their routing statistics are in the output): recompute gives bitwise
    the gradients of no recompute (the same ops rerun), the same expert load (the rerun's
    statistics are dropped), and really reruns: under full the depth's projection runs again in
    the backward, under selective its attention does; the head's loss runs once either way."""
    kw = dict(mtp_mlp_layer_types=["sparse", "sparse"])
    base, model = _step37(**kw), _step37(**kw)
    apply_recompute(model, granularity)
    losses, grads, out = _step(base)
    counts, calls = {}, []
    for k, depth in model.mtp.items():
        _counting(depth.eh_proj, counts, f"proj{k}")
        _counting(depth.block.self_attn, counts, f"attn{k}")
    forward = core.loss.chunked_forward
    monkeypatch.setattr(core.loss, "chunked_forward", lambda *a: calls.append(1) or forward(*a))
    r_losses, r_grads, r_out = _step(model)
    assert torch.equal(losses, r_losses) and grads.keys() == r_grads.keys()
    assert all(torch.equal(grads[n], r_grads[n]) for n in grads)
    assert len(out.expert_load) == 3 + 2 and torch.equal(out.expert_load, r_out.expert_load)
    assert torch.equal(out.aux_loss, r_out.aux_loss)
    proj, attn = (2, 2) if granularity == "full" else (1, 2)
    assert counts == {f"{what}{k}": n for k in model.mtp for what, n in (("proj", proj), ("attn", attn))}
    assert len(calls) == 3  # main head and two depths: the recomputed part stops before the head


def test_a_fully_recomputed_depth_keeps_its_inputs_and_what_its_head_needs():
    """Under full recompute a depth keeps the recomputed part's inputs (checkpoint saves them:
    the shifted embedding, the previous hidden state, the valid mask) and, for its head, the
    head norm's output, the shifted labels and the fp32 logsumexp: T x (3 H x 4 + 1 + 8 + 4)
    bytes in fp32, what ``core.costs.activations.extra_block_bytes`` counts (less the valid mask,
    shared with every layer)."""
    model = _step37()
    apply_recompute(model, "full")
    tokens, pos, psp = thd(LENGTHS, seed=2)
    x, ropes, layout, valid, _ = model._trunk(tokens, pos, psp, None)
    emb, labels = model.embed_tokens(tokens), labels_for(tokens, LENGTHS)
    T, H = tokens.numel(), model.config.hidden_size
    with SavedTensorBytes(model) as saved:
        model.mtp["0"](emb, x, ropes, layout, valid, labels)
    assert saved.bytes == T * (3 * H * 4 + 1 + 8 + 4)
    assert extra_block_bytes(shapes_of(model.config), 0, T, 4, "full") == T * (3 * H * 4 + 8 + 4)
