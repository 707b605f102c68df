"""Axial rotary position embeddings for grids of patches (2-D RoPE of vision transformers).

A patch at grid coordinates ``(a_0, a_1, ...)`` (one coordinate per axis, e.g. (column, row))
rotates each of its ``head_dim / 2`` channel pairs by an angle: the pairs are split evenly
between the axes, in the order the coordinates are given, and within an axis pair ``i`` turns by
``a * theta ** (-2i / (head_dim / axes))``, the 1-D RoPE spectrum over that axis' share of the
channels. The same frequencies serve every axis.

Two pairings of channels into pairs exist in published checkpoints; both are here:

* ``interleaved`` (complex-number form, as original ViT code and its checkpoints store q and k):
  pair ``i`` is channels ``(2i, 2i + 1)``;
* rotate-half (NeoX form): pair ``i`` is channels ``(i, i + head_dim / 2)``.

They give the same attention once q and k rows are permuted accordingly, so a checkpoint keeps
its own form and needs no permutation on import or export.
"""
from __future__ import annotations

import torch

from core.precision import KeepFP32Buffers


def axial_inverse_frequencies(head_dim: int, axes: int, theta: float) -> torch.Tensor:
    """fp32 ``[head_dim / (2 * axes)]``: one axis' RoPE frequencies."""
    if head_dim % (2 * axes):
        raise ValueError(f"axial RoPE: head_dim {head_dim} must be a multiple of 2 x {axes} axes")
    share = head_dim // axes
    return 1.0 / (theta ** (torch.arange(0, share, 2, dtype=torch.int64).float() / share))


def grid_coordinates(height: int, width: int, device=None) -> torch.Tensor:
    """int64 ``[height * width, 2]``: (column, row) of each patch in row-major order."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    return torch.stack([cols, rows], dim=-1)


class Angles:
    """A rotary embedding's ``cos`` and ``sin``, unpacked as ``cos, sin = angles``. FSDP2's mixed
    precision casts the floating tensors among a unit's forward inputs to the compute dtype
    (``MixedPrecisionPolicy.cast_forward_inputs``, walking lists, tuples, dicts and registered
    dataclasses); an object of this plain class is not walked, so fp32 angles reach the rotation
    in fp32 under ``--bf16``, as transformers rotates a vision tower's q and k."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    def __iter__(self):
        return iter((self.cos, self.sin))


class AxialRotaryEmbedding(KeepFP32Buffers):
    """cos/sin ``[N, head_dim / 2]`` (one angle per channel pair) of ``N`` patches from their
    coordinates ``[N, axes]``; computed in fp32, cast to the requested dtype."""

    fp32_buffers = ("inv_freq",)

    def __init__(self, head_dim: int, theta: float, axes: int = 2):
        super().__init__()
        self.head_dim, self.theta, self.axes = head_dim, float(theta), axes
        self.register_buffer("inv_freq", axial_inverse_frequencies(head_dim, axes, theta), persistent=False)

    def reset_buffers(self, device) -> None:
        """Recompute the frequencies in fp32 (after ``to_empty``; ``core/init.py``)."""
        self.inv_freq = axial_inverse_frequencies(self.head_dim, self.axes, self.theta).to(device=device)

    def forward(self, coords: torch.Tensor, dtype: torch.dtype) -> Angles:
        if coords.shape[-1] != self.axes:
            raise ValueError(f"axial RoPE over {self.axes} axes got coordinates of shape {tuple(coords.shape)}")
        angles = (coords.float()[..., None] * self.inv_freq.float()).flatten(-2)  # axis by axis
        return Angles(angles.cos().to(dtype), angles.sin().to(dtype))


def apply_pair_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                      interleaved: bool) -> torch.Tensor:
    """Rotate every channel pair of ``x [..., N, heads, head_dim]`` by the angles of
    ``cos/sin [N, head_dim / 2]`` (fp32 arithmetic, result in ``x``'s dtype)."""
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return out.to(x.dtype)
