"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD
(warmup-stable-decay: constant, then a linear decay over the last ``--lr-wsd-decay-iters``),
never below ``--min-lr``. Expressed as a multiplier of each group's base LR, so the Muon and
AdamW groups follow the same shape with their own peaks.

``total`` is the schedule's length (``--lr-decay-iters``, by default ``--train-iters``); past it
the multiplier stays at its end value. The multiplier is a pure function of the step and the
flags, so a run stopped and resumed, or extended under a fixed ``--lr-decay-iters``, follows the
schedule an uninterrupted run follows."""
from __future__ import annotations

import math

DECAY_STYLES = ("cosine", "linear", "constant", "wsd")


def lr_multiplier(step: int, *, total: int, warmup: int, style: str, min_ratio: float,
                  wsd_decay: int = 0) -> float:
    if style not in DECAY_STYLES:
        raise ValueError(f"--lr-decay-style {style!r}: expected one of {', '.join(DECAY_STYLES)}")
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant":
        return 1.0
    if style == "wsd":
        start = total - wsd_decay
        if step < start:
            return 1.0
        frac = min(1.0, (step - start) / max(1, wsd_decay))
        return 1.0 - (1.0 - min_ratio) * frac
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    if style == "linear":
        return 1.0 - (1.0 - min_ratio) * frac
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * frac))


def apply_lr(optimizer, multiplier: float) -> float:
    """Set every group's lr to ``base_lr * multiplier``; returns the first group's lr."""
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * multiplier
    return optimizer.param_groups[0]["lr"] if optimizer.param_groups else 0.0
