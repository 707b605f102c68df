"""LoRA (core/finetune/lora.py): the flags' refusals name the flag; an adapted linear's and grouped
experts' adapter gradients equal fp64 autograd through ``W + (alpha / r) B A``; step 0 is the
base model bit for bit (B starts at zero) for both families; training moves the adapters only
(the frozen base bit-identical after 3 AdamW steps, optimizer state for the adapters alone).

Tolerance of the gradient checks: 1e-5 relative to the scale of the terms summed: for a linear,
each entry's sum of |terms| (fp64 autograd through the absolute values); for the grouped experts
(a SwiGLU between the projections), the largest adapter gradient of the module. The module runs
in fp32 (each entry a sum of at most ~100 products, ~1e-7 relative rounding each), the reference
in fp64, so 1e-5 leaves two orders of margin and still catches a missing or doubled scale (a
factor alpha / r of 0.25..8)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from core.finetune.lora import LoRAGroupedExperts, LoRALinear, LoraSettings, adapter_params, apply_lora
from core.moe.experts import GroupedExperts
from core.init import materialize_seeded
from core.transformer.mlp import clamped_swiglu
from core.optim.build import build_optimizer
from models import registry
from tests.distributed.parallel_cases import micro_batches, tiny_config
from tests.unit.numerics import assert_close_rel
from train_args import parse, validate

GRAD_REL = 1e-5

# ------------------------------------------------------------------------------------ flags

USAGE = [
    (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank > 0 (LoRA is off)"),
    (["--lora-dropout", "0.1"], "--lora-dropout needs --lora-rank > 0 (LoRA is off)"),
    (["--lora-targets", "attention"], "--lora-targets needs --lora-rank > 0 (LoRA is off)"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0, got -1"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be a finite number > 0, got 0.0"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1.0"),
    (["--lora-rank", "4", "--lora-targets", "attention,router"],
     "--lora-targets router: the router, embeddings, heads and norms are never adapted"),
    (["--lora-rank", "4", "--lora-targets", "embeddings"],
     "--lora-targets embeddings: the router, embeddings, heads and norms are never adapted"),
    (["--lora-rank", "4", "--lora-targets", "qkv"], "--lora-targets 'qkv': expected a comma-separated list of "
                                                      "attention, mlp, shared_expert, experts"),
]


@pytest.mark.parametrize("flags,message", USAGE, ids=[" ".join(f) for f, _ in USAGE])
def test_bad_lora_flag_is_a_usage_error_naming_it(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--data-path", "unused", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


REFUSED = [
    (["--optimizer", "muon"], "--optimizer muon with --lora-rank is not supported: LoRA adapters train with AdamW"),
    (["--optimizer", "dion"], "--optimizer dion with --lora-rank is not supported: LoRA adapters train with AdamW"),
    (["--bf16", "--store-param-remainders"], "--lora-rank with --store-param-remainders is not supported"),
    (["--bf16", "--cpu-offload", "masters", "--global-batch-size", "1"],
     "--lora-rank with --cpu-offload masters is not supported"),
    (["--data-parallel-sharding", "fsdp", "--cpu-offload", "optimizer"],
     "--lora-rank with --cpu-offload optimizer is not supported"),
    (["--recompute-granularity", "full", "--recompute-chunks", "2", "--micro-batch-size", "2",
      "--global-batch-size", "2"], "--lora-rank with --recompute-chunks is not supported"),
    (["--model-preset", "qwen3-moe-tiny", "--lora-targets", "attention,shared_expert"],
     "--lora-targets shared_expert: the model has no such module (it has attention)"),
    # refused on the meta model, before any adapter is allocated (r x (in + out) per module)
    (["--lora-rank", "1000000"], "--lora-rank 1000000 exceeds 4, the smallest min(in, out) of an adapted projection "
                                 "(layers.0.self_attn.g_proj: out 4, in 64): choose a rank of at most 4"),
    # the routers' biases would move (a buffer of the frozen base), and the PEFT export has no place for them
    (["--moe-bias-update-rate", "0.001"], "--moe-bias-update-rate 0.001 with --lora-rank: LoRA freezes the routers, "
                                          "and a PEFT export carries no router bias"),
]


@pytest.mark.parametrize("flags,message", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_what_lora_cannot_serve_is_refused_before_any_model_is_built(flags, message):
    args = parse(["--data-path", "unused", "--lora-rank", "4", *flags])
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        validate(args, 1, check_files=False)


def test_default_targets_adapt_what_the_model_has():
    """Qwen3-MoE has no shared expert: the default (every target) is accepted and adapts the rest."""
    args = parse(["--data-path", "unused", "--model-preset", "qwen3-moe-tiny", "--lora-rank", "4"])
    validate(args, 1, check_files=False)
    assert args.lora.targets == ("attention", "mlp", "shared_expert", "experts") and args.lora.scale == 1.0


# ------------------------------------------------------------------ gradients against fp64


def _fill(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@settings(max_examples=15, deadline=None)
@given(d_in=st.integers(1, 24), d_out=st.integers(1, 24), r=st.integers(1, 6), alpha=st.sampled_from([1.0, 4.0, 16.0]),
       tokens=st.integers(1, 9), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_adapter_gradients_equal_fp64_autograd(d_in, d_out, r, alpha, tokens, bias, seed):
    lin = LoRALinear(torch.nn.Linear(d_in, d_out, bias=bias), r, alpha)
    _fill(lin, seed)
    x = torch.randn(tokens, d_in, generator=torch.Generator().manual_seed(seed + 1))
    g = torch.randn(tokens, d_out, generator=torch.Generator().manual_seed(seed + 2))
    lin.weight.requires_grad_(False)
    (lin(x) * g).sum().backward()

    def grads(absolute: bool):
        """fp64 autograd through ``W + (alpha / r) B A``; with ``absolute``, of every tensor's
        absolute value: each gradient entry's sum of |terms|, the scale its rounding is relative to
        (a gradient that cancels to near zero still carries the rounding of its terms)."""
        f = (lambda t: t.abs()) if absolute else (lambda t: t)
        W, A, B = (f(t.detach().double()).requires_grad_() for t in (lin.weight, lin.lora_A, lin.lora_B))
        y = f(x.double()) @ (W + (alpha / r) * B @ A).T + (f(lin.bias.detach().double()) if bias else 0)
        (y * f(g.double())).sum().backward()
        return A.grad, B.grad

    (A, B), (A_terms, B_terms) = grads(False), grads(True)
    assert ((lin.lora_A.grad.double() - A).abs() <= GRAD_REL * A_terms).all()
    assert ((lin.lora_B.grad.double() - B).abs() <= GRAD_REL * B_terms).all()
    assert lin.weight.grad is None  # frozen: nothing computed for it


def _reference_experts(ex: LoRAGroupedExperts, x, counts, g):
    """fp64, per expert: ``W_e + scale B_e A_e`` for each projection, the same SwiGLU."""
    p64 = {n: getattr(ex, n).detach().double() for n in ex.PROJECTIONS}
    A = {n: ex.lora_A[n].detach().double().requires_grad_() for n in ex.PROJECTIONS}
    B = {n: ex.lora_B[n].detach().double().requires_grad_() for n in ex.PROJECTIONS}
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        xe = x[start:start + c].double()
        w = {n: p64[n][e] + ex.scale * B[n][e] @ A[n][e] for n in ex.PROJECTIONS}
        h = clamped_swiglu(xe @ w["gate_proj"].T, xe @ w["up_proj"].T, ex.limit)
        outs.append(h @ w["down_proj"].T)
        start += c
    (torch.cat(outs) * g.double()).sum().backward()
    return A, B


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
@settings(max_examples=8, deadline=None)
@given(E=st.integers(1, 4), r=st.sampled_from([4, 8]), alpha=st.sampled_from([2.0, 8.0]),
       counts=st.lists(st.integers(0, 5), min_size=4, max_size=4), limit=st.sampled_from([None, 2.0]),
       seed=st.integers(0, 2**16))
def test_grouped_expert_adapter_gradients_equal_fp64_autograd(grouped, E, r, alpha, counts, limit, seed):
    """Hidden 8 and expert size 12 (fp32 rows 16-byte aligned, as grouped_mm needs; rank 4 and 8
    too): the grouped GEMM path and the per-expert loop, an expert with no token included."""
    base = GroupedExperts(E, 8, 12, limit)
    base.use_grouped_mm = grouped
    ex = LoRAGroupedExperts(base, r, alpha)
    _fill(ex, seed)
    for n in ex.PROJECTIONS:
        getattr(ex, n).requires_grad_(False)
    counts_E = torch.tensor(counts[:E])
    N = int(counts_E.sum())
    x = torch.randn(N, 8, generator=torch.Generator().manual_seed(seed + 1))
    g = torch.randn(N, 8, generator=torch.Generator().manual_seed(seed + 2))
    (ex(x, counts_E) * g).sum().backward()
    A, B = _reference_experts(ex, x, counts_E, g)
    # relative to the largest adapter gradient of the module (one projection's can cancel to near
    # zero while carrying its terms' rounding)
    scale = max(float(t.grad.abs().max()) for t in [*A.values(), *B.values()])
    for n in ex.PROJECTIONS:
        assert float((ex.lora_A[n].grad.double() - A[n].grad).abs().max()) <= GRAD_REL * scale
        assert float((ex.lora_B[n].grad.double() - B[n].grad).abs().max()) <= GRAD_REL * scale
        assert getattr(ex, n).grad is None


# ------------------------------------------------------------------ whole models


def _lora_model(cfg, rank=4, alpha=8.0, targets="attention,mlp,shared_expert,experts"):
    spec = registry.spec_of(cfg)
    with torch.device("meta"):
        model = spec.build(cfg)
    n = apply_lora(model, LoraSettings(lora_rank=rank, lora_alpha=alpha, lora_targets=targets))
    materialize_seeded(model, "cpu", seed=0, std=cfg.init_std)
    return model, n


def _loss(model, batch):
    out = model(batch.tokens, batch.position_ids, batch.packed_seq_params, labels=batch.labels)
    return out.loss_sum, out.mtp_loss_sums


@pytest.mark.parametrize("family", ["step37", "qwen3_moe"])
def test_step_zero_is_the_base_model_bit_for_bit(family):
    cfg = tiny_config(family)
    base = registry.spec_of(cfg).build(cfg, seed=0)
    model, n = _lora_model(cfg)
    assert n > 0
    specs = model.param_specs()
    adapters = {name for name, s in specs.items() if s.role == "adapter"}
    assert adapters and all(("lora_A" in a or "lora_B" in a) for a in adapters)
    base_params = dict(base.named_parameters())
    for name, p in model.named_parameters():  # same names, same values: the adapters are extra
        if name not in adapters:
            assert torch.equal(p, base_params[name]), name
            assert not p.requires_grad, name
    for name in adapters:
        p = dict(model.named_parameters())[name]
        assert p.requires_grad and p.dtype == torch.float32
        assert (p == 0).all() if "lora_B" in name else p.abs().sum() > 0, name
    for batch in micro_batches(1, 2, cfg.vocab_size)[0]:
        (want, want_mtp), (got, got_mtp) = _loss(base, batch), _loss(model, batch)
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_mtp, want_mtp))


@pytest.mark.parametrize("family", ["step37", "qwen3_moe"])
def test_training_moves_only_the_adapters(family):
    """3 AdamW steps through build_optimizer: the adapters move, every base parameter stays
    bit-identical and has no gradient; optimizer state exists for the adapters alone; the
    router, embeddings and heads are never adapted."""
    cfg = tiny_config(family)
    model, _ = _lora_model(cfg)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt_args = parse(["--data-path", "unused", "--lora-rank", "4", "--lr", "1e-2"]).optim
    opt, summary = build_optimizer([model], opt_args)
    adapters = [p for p in model.parameters() if p.requires_grad]
    # the start-up summary lists the adapters as their own group, not among embeddings and heads
    assert (f"AdamW 0 tensors / 0 params (embeddings, heads, matrices; lr 0.01); LoRA adapters {len(adapters)} "
            f"tensors / {sum(p.numel() for p in adapters):,} params (AdamW, lr 0.01)") in summary, summary
    assert f"frozen {sum(t.numel() for t in base.values()):,} params" in summary
    for step, batch in enumerate(micro_batches(1, 3, cfg.vocab_size)[0]):
        opt.zero_grad()
        loss, mtp = _loss(model, batch)
        (loss + 0.3 * sum(mtp)).backward()
        opt.step()
    adapters = adapter_params(model)
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]) and p.grad is None, n
        else:
            assert id(p) in adapters
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    state = opt.optimizers["adamw"].state
    assert set(map(id, state)) == adapters
    for n, _ in model.named_parameters():
        if any(k in n for k in ("router", "embed_tokens", "lm_head", ".head.", "norm")):
            assert n in base, n


# ------------------------------------------------------------------ checkpoints' identity


def _record(rank=4, fp="a" * 16, hf="/base"):
    return {"rank": rank, "alpha": 8.0, "dropout": 0.0, "targets": ["attention"],
            "base": {"load_hf": hf, "seed": None, "config_sha256": "c" * 16, "weights_fingerprint": fp}}


@pytest.mark.parametrize("saved,run,message", [
    (None, _record(), "--load CK: not a LoRA checkpoint (it holds every weight)"),
    (_record(), None, "--load CK: a LoRA checkpoint (adapters of rank 4 only, on the base /base); resume it with "
                      "--lora-rank 4 --lora-alpha 8 --lora-targets attention and --load-hf of that base"),
    (_record(), _record(fp="b" * 16, hf="/other"), "--load CK: its adapters were trained on another base: the "
     "weights differ (checkpoint aaaaaaaaaaaaaaaa from /base, this run bbbbbbbbbbbbbbbb from /other)"),
])
def test_a_lora_checkpoint_resumes_only_onto_its_base(saved, run, message):
    """(Its flags: tests/unit/test_resume_flags.py, generated from RESUME_MUST_MATCH.)"""
    from training.checkpoints import CheckpointError, check_lora_base

    with pytest.raises(CheckpointError) as e:
        check_lora_base("CK", saved, run)
    assert str(e.value).startswith(message)
    check_lora_base("CK", _record(), _record())  # the same base and flags: accepted


def test_base_fingerprint_sees_every_row():
    from core.finetune.lora import base_fingerprint

    cfg = tiny_config("qwen3_moe")
    model, _ = _lora_model(cfg)
    fp = base_fingerprint([model])
    assert fp == base_fingerprint([model]) and len(fp) == 16
    q = model.layers["0"].self_attn.q_proj
    with torch.no_grad():
        q.lora_A.add_(1.0)  # adapters are not the base
        assert base_fingerprint([model]) == fp
        q.weight[[0, 1]] = q.weight[[1, 0]].clone()  # two rows swapped: same values, other places
        assert base_fingerprint([model]) != fp


# ------------------------------------------------------------------ export


def test_merge_folds_the_adapters_into_a_plain_model():
    """After merging, the model has the base's parameter names only and gives the adapted
    model's logits (1e-5 relative: W + s B A rounded once to fp32 instead of two fp32 GEMMs)."""
    from core.finetune.lora_export import merge_lora
    from tests.unit.test_model_hf import thd

    cfg = tiny_config("step37")
    model, _ = _lora_model(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    tokens, pos, psp = thd([9, 6], vocab=cfg.vocab_size)
    with torch.no_grad():
        want = model(tokens, pos, psp)
        assert merge_lora(model) > 0
        got = model(tokens, pos, psp)
    base_names = {n for n, _ in registry.spec_of(cfg).build(cfg, seed=0).named_parameters()}
    assert {n for n, _ in model.named_parameters()} == base_names
    assert_close_rel(got, want, rel=1e-5)


def test_peft_export_refuses_experts_published_stacked():
    """Step-3.7 publishes its experts stacked: no per-expert module for PEFT, so the export
    refuses (naming --merge-lora) instead of writing a partial adapter; without expert
    adapters it writes PEFT's names for transformers' modules (a text config: Step3p7TextModel's;
    the MTP depths' adapters left out, transformers has no MTP module)."""
    from core.finetune.lora_export import peft_tensors

    cfg = tiny_config("step37")
    with pytest.raises(ValueError, match="published stacked .* export the merged weights with --merge-lora"):
        peft_tensors(_lora_model(cfg)[0])
    tensors, modules = peft_tensors(_lora_model(cfg, targets="attention,shared_expert")[0])
    assert "base_model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert "base_model.model.layers.1.mlp.shared_experts.up_proj.lora_B.weight" in tensors
    assert not any("mtp" in k or f"layers.{cfg.num_layers}." in k for k in tensors)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in tensors)


def test_a_lora_checkpoint_leaves_the_frozen_base_out_on_a_stage_without_adapters():
    """Whether a checkpoint leaves frozen parameters out is the run's (meta.json's ``lora``), not
    what one pipeline rank holds: a first stage with only a dense layer and ``--lora-targets
    experts`` has no adapter, yet saves none of its frozen base; a run that froze parts with
    ``--freeze-*`` (no ``lora``) saves them."""
    from core.checkpoint.sharded import model_state
    from core.finetune.lora import adapter_params

    cfg = tiny_config("step37")
    assert cfg.mlp_layer_types[0] == "dense"
    stage = registry.spec_of(cfg).build(cfg, layers=[0], first=True, last=False)
    apply_lora(stage, LoraSettings(lora_rank=4, lora_targets="experts"))
    assert not adapter_params(stage) and not any(p.requires_grad for p in stage.parameters())
    params = {f"model/{n}" for n, _ in stage.named_parameters()}
    assert not params & set(model_state([stage], lora=True))
    assert params <= set(model_state([stage], lora=False))
