"""The LR schedule past its end (--lr-decay-iters shorter than --train-iters): each style stays
at its end value, as Megatron's does."""
from __future__ import annotations

import pytest

from core.optim.lr_schedule import DECAY_STYLES, lr_multiplier


@pytest.mark.parametrize("style", DECAY_STYLES)
def test_past_the_schedule_the_multiplier_stays_at_its_end_value(style):
    kw = dict(total=100, warmup=10, style=style, min_ratio=0.1, wsd_decay=20)
    end = lr_multiplier(100, **kw)
    assert end == pytest.approx(1.0 if style == "constant" else 0.1)
    assert [lr_multiplier(s, **kw) for s in (101, 150, 10_000)] == [end] * 3


def test_warmup_then_cosine_by_hand():
    kw = dict(total=55, warmup=5, style="cosine", min_ratio=0.0)
    assert lr_multiplier(4, **kw) == pytest.approx(1.0)   # warmup: (step + 1) / warmup
    assert lr_multiplier(30, **kw) == pytest.approx(0.5)  # (30 - 5) / 50 = half-way down the cosine
