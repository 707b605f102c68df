"""Rotary position embeddings from THD position ids: per-layer-type theta, partial rotary
(only the first ``head_dim * factor`` dims rotate, NeoX rotate-half), llama3 frequency scaling.

``rope_parameters`` uses transformers' keys: ``rope_type`` ("default" | "llama3"),
``rope_theta``, ``partial_rotary_factor``, and for llama3 ``factor``, ``low_freq_factor``,
``high_freq_factor``, ``original_max_position_embeddings``.
"""
from __future__ import annotations

import math

import torch

from core.precision import KeepFP32Buffers


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if params.get("rope_type", "default") == "llama3":
        inv = _llama3_scale(inv, params)
    return inv


def _llama3_scale(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(KeepFP32Buffers):
    """cos/sin ``[T, rot_dim]`` for one layer type (computed in fp32, cast to the input dtype);
    the frequencies stay fp32 through any ``.to(dtype)``."""

    fp32_buffers = ("inv_freq",)

    def __init__(self, head_dim: int, params: dict):
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, params), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of each head; pass the rest through."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x_THD[..., :rot], x_THD[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
