"""A vision-transformer encoder layer: pre-LayerNorm, bidirectional multi-head attention over
one image's patches with 2-D rotary positions, an MLP with the configured activation, and
optional layer scale on both residual branches::

    x = x + scale_1 * attn(norm_1(x))
    x = x + scale_2 * mlp(norm_2(x))

Images are not packed: every view of one size is one batch ``[B, N, hidden]``, each attends
within itself (one ``scaled_dot_product_attention`` call, flash on GPUs in 16 bits). q, k and v
come from one fused projection ``qkv`` (rows q, then k, then v, as checkpoints of this design
store ``in_proj``), with biases.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.memory_mode import RecomputePlacement
from core.transformer.axial_rotary import apply_pair_rotary


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (CLIP's GELU approximation)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; expected one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that tells ``core/init.py`` its initial values (weight 1, bias 0)."""

    def constant_init(self) -> dict[str, float]:
        return {"weight": 1.0, "bias": 0.0}


class BiasedLinear(nn.Linear):
    """``nn.Linear`` whose bias starts at zero (``core/init.py`` draws only the weight)."""

    def constant_init(self) -> dict[str, float]:
        return {"bias": 0.0} if self.bias is not None else {}


class LayerScale(nn.Module):
    """A learned per-channel factor on a residual branch, initialised to ``init``."""

    def __init__(self, dim: int, init: float):
        super().__init__()
        self.init = float(init)
        self.gamma = nn.Parameter(torch.full((dim,), self.init))

    def constant_init(self) -> dict[str, float]:
        return {"gamma": self.init}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gamma * x


class ViTAttention(nn.Module):
    """Bidirectional multi-head self-attention of ``[B, N, hidden]`` patches; rotary angles
    ``[N, head_dim / 2]`` shared by the batch (``core/transformer/axial_rotary.py``)."""

    def __init__(self, hidden: int, num_heads: int, *, interleaved_rope: bool = True):
        super().__init__()
        if hidden % num_heads:
            raise ValueError(f"ViT attention: hidden size {hidden} does not split into {num_heads} heads")
        self.num_heads, self.head_dim = num_heads, hidden // num_heads
        self.interleaved = interleaved_rope
        self.qkv = BiasedLinear(hidden, 3 * hidden)
        self.proj = BiasedLinear(hidden, hidden)

    def forward(self, x_BNH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, N, H = x_BNH.shape
        q, k, v = self.qkv(x_BNH).view(B, N, 3, self.num_heads, self.head_dim).unbind(2)
        cos, sin = rope
        q = apply_pair_rotary(q, cos, sin, interleaved=self.interleaved)
        k = apply_pair_rotary(k, cos, sin, interleaved=self.interleaved)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           scale=self.head_dim ** -0.5)
        return self.proj(o.transpose(1, 2).reshape(B, N, H))


class ViTMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.fc1 = BiasedLinear(hidden, intermediate)
        self.fc2 = BiasedLinear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTLayer(nn.Module):
    """One pre-norm encoder layer (see the module docstring); ``layer_scale=None``: no scale.
    ``recompute_placement`` (set by ``core.transformer.block.apply_recompute``): ``full`` keeps only
    the layer's input for backward, ``selective`` drops the attention's and the MLP's internals."""

    recompute_placement: RecomputePlacement = RecomputePlacement()

    @property
    def recompute(self) -> str:
        return self.recompute_placement.granularity

    def __init__(self, hidden: int, num_heads: int, intermediate: int, *, act: str = "gelu",
                 eps: float = 1e-5, layer_scale: float | None = None, interleaved_rope: bool = True):
        super().__init__()
        self.norm1 = LayerNorm(hidden, eps=eps)
        self.attn = ViTAttention(hidden, num_heads, interleaved_rope=interleaved_rope)
        self.norm2 = LayerNorm(hidden, eps=eps)
        self.mlp = ViTMLP(hidden, intermediate, act)
        self.scale1 = LayerScale(hidden, layer_scale) if layer_scale is not None else nn.Identity()
        self.scale2 = LayerScale(hidden, layer_scale) if layer_scale is not None else nn.Identity()

    def forward(self, x_BNH, rope):
        """``x_BNH [B, N, hidden]`` with its ``rope``, or lists of both: batches of views of
        several sizes in one call, so a layer that is an FSDP unit gathers its weights once per
        call whatever the number of view sizes (every rank then issues the same collectives)."""
        if isinstance(x_BNH, (list, tuple)):
            return [self._run(x, r) for x, r in zip(x_BNH, rope)]
        return self._run(x_BNH, rope)

    def _run(self, x_BNH, rope):
        if self.recompute_placement.full and torch.is_grad_enabled():
            return checkpoint(self._one, x_BNH, rope, use_reentrant=False)
        return self._one(x_BNH, rope)

    def _one(self, x_BNH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        selective = self.recompute_placement.selective and torch.is_grad_enabled()
        h = self.norm1(x_BNH)
        h = checkpoint(self.attn, h, rope, use_reentrant=False) if selective else self.attn(h, rope)
        x_BNH = x_BNH + self.scale1(h)
        h = self.norm2(x_BNH)
        h = checkpoint(self.mlp, h, use_reentrant=False) if selective else self.mlp(h)
        return x_BNH + self.scale2(h)
