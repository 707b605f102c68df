"""Tolerances for numerics tests are relative to the scale of the values compared, and each one
says in a comment why it is that number (precision, what is summed in a different order, the
error measured, the margin left)."""
from __future__ import annotations

import torch


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, *, rel: float) -> None:
    """max |a - b| <= rel * max |b|: the difference relative to the reference's largest value
    (elementwise relative error is meaningless for entries near zero)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert diff <= rel * scale, f"max |a - b| = {diff:.3g} > {rel:g} * max |b| = {rel * scale:.3g}"
