"""What stays fp32 whatever the model's dtype: RoPE frequencies and the router's balancing bias
survive ``.to(bfloat16)`` bit for bit; the published ``need_fp32_gate`` is read and written."""
from __future__ import annotations

import torch

from models.step37 import Step37Config, Step37Model


def test_rope_frequencies_and_router_bias_stay_exact_fp32_through_a_cast():
    model = Step37Model(Step37Config.preset("tiny"))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.linspace(-1e-3, 1e-3, b.numel()) + 1.0 / 3)  # values bf16 cannot hold
    before = {n: b.clone() for n, b in model.named_buffers()}
    assert any(n.endswith("inv_freq") for n in before) and any(n.endswith("correction_bias") for n in before)
    model.to(torch.bfloat16)
    for name, b in model.named_buffers():
        assert b.dtype == torch.float32 and torch.equal(b, before[name]), name
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the cast itself happened
    rounded = before[next(n for n in before if n.endswith("inv_freq"))].bfloat16().float()
    assert not torch.equal(rounded, before[next(n for n in before if n.endswith("inv_freq"))])


def test_need_fp32_gate_round_trips_and_makes_the_router_an_fp32_unit():
    cfg = Step37Config.preset("tiny")
    hf = cfg.to_hf()
    assert hf["need_fp32_gate"] is True
    off = Step37Config.from_hf({**hf, "need_fp32_gate": False})
    assert off.need_fp32_gate is False and off.to_hf()["need_fp32_gate"] is False
    fp32_units = [u for u in Step37Model(cfg).fsdp_units() if u.fp32]
    assert fp32_units and all(type(u.module).__name__ == "TopKRouter" for u in fp32_units)
    assert not [u for u in Step37Model(off).fsdp_units() if u.fp32]
