"""Rotary position embeddings from THD position ids: per-layer-type theta, partial rotary
(only the first ``head_dim * factor`` dims rotate, NeoX rotate-half; or adjacent pairs:
:func:`apply_rotary_interleaved`), and the frequency
scalings published configs use: ``linear``, ``llama3`` and ``yarn`` (with its attention factor
on cos/sin) and :func:`yarn_softmax_scale`, the factor some models also put on the softmax scale.

``rope_parameters`` uses transformers' keys: ``rope_type`` ("default" | "linear" | "llama3" |
"yarn"), ``rope_theta``, ``partial_rotary_factor``; ``factor`` for the scalings; for llama3
``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``; for yarn
``original_max_position_embeddings`` and optionally ``attention_factor``, ``beta_fast``,
``beta_slow``, ``mscale``, ``mscale_all_dim``, ``truncate`` (transformers' defaults).
"""
from __future__ import annotations

import math

import torch

from core.precision import KeepFP32Buffers

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rotary_dim(head_dim: int, params: dict) -> int:
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    dim = rotary_dim(head_dim, params)
    kind = params.get("rope_type", "default")
    if kind == "yarn":
        return _yarn(dim, params)[0]
    inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "llama3":
        inv = _llama3_scale(inv, params)
    elif kind == "linear":
        inv = inv / params["factor"]
    return inv


def attention_scaling(head_dim: int, params: dict) -> float:
    """The factor on cos and sin (yarn's attention temperature; 1 otherwise)."""
    return _yarn(rotary_dim(head_dim, params), params)[1] if params.get("rope_type") == "yarn" else 1.0


def yarn_softmax_scale(scale: float, params: dict) -> float:
    """``scale`` times the factor a model whose rope parameters carry ``mscale_all_dim`` puts on
    its softmax scale (DeepSeek's MLA: ``mscale(factor, mscale_all_dim)`` twice, in transformers'
    order, ``yarn_apply_mscale``: for any rope type but ``default``); ``scale`` otherwise."""
    m_all = params.get("mscale_all_dim")
    if params.get("rope_type", "default") == "default" or not m_all:
        return scale
    m = _mscale(params["factor"], m_all)
    return scale * m * m


def _llama3_scale(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, p: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) as transformers computes it: interpolated frequencies below the
    correction range, extrapolated above it, a linear ramp between; cos/sin scaled by the
    attention factor."""
    base, factor, old_ctx = p["rope_theta"], p["factor"], p["original_max_position_embeddings"]
    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = float(_mscale(factor, m) / _mscale(factor, m_all)) if m and m_all else _mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(fast), correction_dim(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the extrapolated frequency
    return interpolation * (1 - keep) + extrapolation * keep, attn


class RotaryEmbedding(KeepFP32Buffers):
    """cos/sin ``[T, rot_dim]`` for one layer type (computed in fp32, cast to the input dtype);
    the frequencies stay fp32 through any ``.to(dtype)``."""

    fp32_buffers = ("inv_freq",)

    def __init__(self, head_dim: int, params: dict):
        super().__init__()
        self.head_dim, self.params = head_dim, dict(params)
        self.scale = attention_scaling(head_dim, params)
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, params), persistent=False)

    def reset_buffers(self, device) -> None:
        """Recompute the frequencies in fp32 (after ``to_empty``; ``core/init.py``)."""
        self.inv_freq = inverse_frequencies(self.head_dim, self.params).to(device=device, dtype=torch.float32)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of each head; pass the rest through."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if rot == x_THD.shape[-1]:
        return x_THD * cos + _rotate_half(x_THD) * sin
    x_rot, x_pass = x_THD[..., :rot], x_THD[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def apply_rotary_interleaved(x_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate all of each head's dims as interleaved pairs ``(x0, x1), (x2, x3), ...``, pair ``i``
    by frequency ``i`` (``cos``/``sin`` as :class:`RotaryEmbedding` gives them: the first half
    holds one angle per pair); the output lists the pairs' first members, then their second
    (transformers' ``apply_rotary_pos_emb_interleave``, which q and k share, so q.k is the
    rotation of the interleaved layout)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x_THD[..., 0::2], x_THD[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
