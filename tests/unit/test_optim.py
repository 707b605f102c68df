"""Muon, Dion, grouping and LR schedules."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from core.model_api import ParamSpec
from core.optim.build import build_optimizer, classify
from core.optim.dion import Dion
from core.optim.lr_schedule import lr_multiplier
from core.optim.muon import Muon, newton_schulz
from tests.unit.numerics import assert_close_rel


@pytest.mark.parametrize("adjust, torch_adjust", [("spectral", "original"), ("rms", "match_rms_adamw")])
@pytest.mark.parametrize("shape", [(32, 16), (16, 48)])
def test_muon_equals_torch_muon_on_matrices(adjust, torch_adjust, shape):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(shape))
    b = torch.nn.Parameter(a.detach().clone())
    ours = Muon([a], lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.05, lr_adjust=adjust)
    ref = torch.optim.Muon([b], lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.05,
                           adjust_lr_fn=torch_adjust)
    for step in range(4):
        g = torch.randn(shape)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        assert torch.equal(a, b), step


def test_momentum_zero_keeps_no_state():
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = Muon([p], momentum=0.0)
    p.grad = torch.randn(8, 8)
    before = p.detach().clone()
    opt.step()
    assert len(opt.state) == 0 and not torch.equal(p, before)
    with_mom = Muon([p], momentum=0.95)
    with_mom.step()
    assert len(with_mom.state) == 1  # the buffer exists only when momentum is on


def test_expert_stack_equals_loop_over_experts():
    torch.manual_seed(1)
    stack = torch.nn.Parameter(torch.randn(4, 24, 16))
    singles = [torch.nn.Parameter(stack[e].detach().clone()) for e in range(4)]
    kw = dict(lr=0.01, momentum=0.9, weight_decay=0.1, ns_dtype=torch.float32)
    a, b = Muon([stack], **kw), Muon(singles, **kw)
    for _ in range(3):
        g = torch.randn(4, 24, 16)
        stack.grad = g.clone()
        for e, p in enumerate(singles):
            p.grad = g[e].clone()
        a.step()
        b.step()
    # fp32, batched vs per-matrix Newton-Schulz: bit-identical on CPU today (measured 0 over 20
    # seeds), but a BLAS may block bmm and mm differently: each side is within 1.8e-7 relative of
    # an fp64 run, so they differ by < 1e-6; 1e-5 leaves 10x margin
    for e in range(4):
        assert_close_rel(stack[e].detach(), singles[e].detach(), rel=1e-5)


@pytest.mark.parametrize("method", ["quintic", "polar_express"])
def test_newton_schulz_orthogonalises(method):
    torch.manual_seed(2)
    g = torch.randn(64, 32)
    s = torch.linalg.svdvals(newton_schulz(g, steps=8, method=method, dtype=torch.float32))
    lo, hi = (0.6, 1.25) if method == "quintic" else (0.9, 1.1)  # quintic: S' in ~(0.7, 1.2)
    assert lo < s.min() and s.max() < hi


def test_dion_full_rank_momentum_zero_converges_to_the_polar_factor():
    torch.manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(12, 12))
    vh = torch.linalg.qr(torch.randn(20, 12))[0].T
    g = u @ torch.diag(1.5 ** -torch.arange(12.0)) @ vh  # distinct singular values: fast convergence
    polar = u @ vh
    p = torch.nn.Parameter(torch.zeros(12, 20))
    opt = Dion([p], lr=1.0, momentum=0.0, rank_fraction=1.0, weight_decay=0.0)
    for _ in range(30):  # warm-started power iteration on a steady gradient
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        # full rank, mu 0: nothing left over but fp32 rounding of the residual, measured <= 7.5e-7
        # of the gradient's largest entry over 20 seeds; 1e-5 leaves ~13x margin
        assert opt.state[p]["momentum"].abs().max() <= 1e-5 * g.abs().max()
    step = (before - p.detach()) / math.sqrt(12 / 20)
    # converged (singular-value ratio 1/1.5, 30 power steps), so fp32 rounding dominates: the step
    # is the difference of parameters ~30x its size; measured <= 6.5e-6 relative over 20 seeds;
    # 5e-5 leaves ~8x margin
    assert_close_rel(step, polar, rel=5e-5)


def test_dion_low_rank_error_feedback_keeps_the_rest():
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.zeros(16, 16))
    opt = Dion([p], lr=0.1, momentum=0.5, rank_fraction=0.25, weight_decay=0.0)
    p.grad = torch.randn(16, 16)
    opt.step()
    assert opt.state[p]["Q"].shape == (16, 4) and opt.state[p]["momentum"].abs().sum() > 0


def _cfg(**kw):
    base = dict(optimizer="muon", lr=0.02, adamw_lr=3e-4, weight_decay=0.1, adam_beta1=0.9,
                adam_beta2=0.95, adam_eps=1e-8, muon_momentum=0.0, muon_nesterov=True, muon_ns_steps=5,
                muon_ns_method="quintic", muon_lr_adjust="spectral", dion_momentum=0.95,
                dion_rank_fraction=0.5)
    return SimpleNamespace(**{**base, **kw})


class _ThreeParams(torch.nn.Module):
    """A model that declares its parameters' roles, as core's contract asks."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(4, 4))
        self.q_proj = torch.nn.Parameter(torch.zeros(4, 4))
        self.norm = torch.nn.Parameter(torch.zeros(4))

    def param_specs(self):
        return {"embed": ParamSpec(role="embedding"), "q_proj": ParamSpec(), "norm": ParamSpec()}


def test_grouping_rules():
    t2, t1 = torch.zeros(4, 4), torch.zeros(4)
    assert classify(ParamSpec(role="embedding"), t2, "muon") == "adamw"
    assert classify(ParamSpec(role="head"), t2, "muon") == "adamw"
    assert classify(ParamSpec(role="head"), t1, "muon") == "adamw_no_wd"
    assert classify(ParamSpec(replicated_over="expert_dp", expert_offset=0), torch.zeros(2, 4, 4), "muon") == "matrix"
    assert classify(ParamSpec(), t2, "adamw") == "adamw"
    model = _ThreeParams()
    opt, summary = build_optimizer([model], _cfg())
    assert set(opt.optimizers) == {"adamw", "muon"} and "muon matrices 1 tensors" in summary
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    # AdamW: exp_avg + exp_avg_sq + a step counter per tensor; Muon with mu = 0: nothing
    assert opt.state_bytes() == 2 * (16 + 4) * 4 + 2 * 4


def test_step37_declares_its_embedding_heads_and_experts():
    from models.step37 import Step37Config, Step37Model

    model = Step37Model(Step37Config.preset("tiny"))
    specs = model.param_specs()
    assert set(specs) == {n for n, _ in model.named_parameters()}
    roles = {n: s.role for n, s in specs.items() if s.role != "weight"}
    assert roles == {"embed_tokens.weight": "embedding", "lm_head.weight": "head",
                     "mtp.0.head.weight": "head", "mtp.1.head.weight": "head"}
    assert specs["embed_tokens.weight"].tied  # MTP: the last stage holds a copy
    experts = {n for n, s in specs.items() if s.replicated_over == "expert_dp"}
    assert experts == {n for n in specs if ".moe.experts." in n} and experts
    assert all(specs[n].expert_offset == 0 for n in experts)


def test_lr_schedules():
    # pytest.approx: 1e-6 relative (its default); each value is a few float ops on O(1) numbers
    kw = dict(total=100, warmup=10, min_ratio=0.1)
    assert lr_multiplier(0, style="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, style="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(10, style="cosine", **kw) == pytest.approx(1.0)
    assert lr_multiplier(55, style="cosine", **kw) == pytest.approx(0.55)
    assert lr_multiplier(100, style="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(55, style="linear", **kw) == pytest.approx(0.55)
    assert lr_multiplier(80, style="constant", **kw) == 1.0
    assert lr_multiplier(80, style="wsd", wsd_decay=20, **kw) == 1.0
    assert lr_multiplier(90, style="wsd", wsd_decay=20, **kw) == pytest.approx(0.55)
    with pytest.raises(ValueError, match="--lr-decay-style 'step'"):
        lr_multiplier(0, style="step", **kw)
