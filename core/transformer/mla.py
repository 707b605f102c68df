"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, Moonlight) on THD input, numerically
transformers' ``DeepseekV3Attention``.

    q    = q_proj(x)                                  (q_lora_rank None)
         | q_b_proj(q_a_layernorm(q_a_proj(x)))        [T, heads, nope + rope]
    c, r = kv_a_proj_with_mqa(x)                       latent [T, kv_lora_rank], one rope key [T, rope]
    k_nope, v = kv_b_proj(kv_a_layernorm(c))           [T, heads, nope], [T, heads, v_head_dim]
    k    = [k_nope, rope(r)] (the rope key shared by every head); q = [q_nope, rope(q_rope)]
    out  = o_proj(attend(q, k, v))

RoPE turns only the last ``qk_rope_head_dim`` dims of q and k (rotate-half, or adjacent pairs with
``interleaved``: ``rope_interleave``, DeepSeek's checkpoints' layout); the block's cos/sin come
from a :class:`~core.transformer.rotary.RotaryEmbedding` of that many dims. The softmax scale is
the family's (``(nope + rope) ** -0.5``, times YaRN's ``mscale_all_dim`` factor twice:
:func:`~core.transformer.rotary.yarn_softmax_scale`).

The value head dim differs from the query/key head dim (128 vs 192 on DeepSeek-V3):
:func:`core.transformer.attention.attend` computes with it as it is on ``sdpa`` and pads V to the
q/k dim for kernels that need equal dims (flash ``varlen``, ``flex``, TE, ``--compile``), then
crops the output, as transformers does for flash. K and V are expanded per head before the kernel
(no weight absorption: training computes every query against every key anyway).

Context parallelism exchanges the compressed latent, not the expanded K/V: each CP rank computes
its tokens' normed latent and roped shared key (``[T/N, kv_lora_rank + rope]``, rope at the
tokens' own positions), the all-gather moves those (its backward reduce-scatters their
gradients), and ``kv_b_proj`` expands the key buffer's latent rows into per-head K and V on every
rank (:meth:`core.context_parallel.attention.ContextParallel.latent`). Per token that moves
``kv_lora_rank + rope`` values (576 on DeepSeek-V3) instead of ``heads x (nope + rope + v)``
(40960), at the cost of running ``kv_b_proj`` on the ``(1 + 1/2N) T`` key rows each rank reads.

LoRA's ``attention`` target adapts the projections (``lora_projections``), never the latent norms.
The planner's costs of this module are :class:`core.costs.shapes.MLAShape`'s.
"""
from __future__ import annotations

import torch
from torch import nn

from core.context_parallel.attention import cp_latent_attention
from core.transformer.attention import attend
from core.transformer.attention_backends import DocLayout
from core.transformer.norm import RMSNorm
from core.transformer.rotary import apply_rotary, apply_rotary_interleaved

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm keep RMSNorm's default eps


class MLAttention(nn.Module):
    # the attention protocol (core/transformer/attention.py): q_proj or q_a_proj + q_b_proj, as
    # q_lora_rank builds; the latent norms are never adapted
    lora_projections = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    supports_context_parallel = True  # the latent exchange (see the module docstring)
    context_parallel = None  # core.context_parallel.ContextParallel, set by apply_context_parallel

    def __init__(self, hidden: int, num_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, softmax_scale: float,
                 interleaved: bool = True, backend: str = "auto", bias: bool = False,
                 latent_eps: float = LATENT_NORM_EPS):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.head_dim = qk_nope_head_dim + qk_rope_head_dim  # q and k
        self.scale, self.backend, self.interleaved = softmax_scale, backend, interleaved
        self.window = None  # MLA families attend to their whole document
        q_out = num_heads * self.head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, latent_eps, offset=False)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_eps, offset=False)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden, bias=bias)

    def _query(self, x_TH: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x_TH)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_TH)))

    def forward(self, x_TH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                layout: DocLayout) -> torch.Tensor:
        T, H = x_TH.shape[0], self.num_heads
        q_nope, q_rot = self._query(x_TH).view(T, H, self.head_dim).split([self.nope, self.rope], -1)
        latent_TC, k_rot = self.kv_a_proj_with_mqa(x_TH).split([self.kv_lora_rank, self.rope], -1)
        cos, sin = rope
        turn = apply_rotary_interleaved if self.interleaved else apply_rotary
        q = torch.cat([q_nope, turn(q_rot, cos, sin)], -1)
        # per token: the normed latent and the roped key shared by every head (what CP moves)
        kv_TC = torch.cat([self.kv_a_layernorm(latent_TC), turn(k_rot[:, None, :], cos, sin)[:, 0]], -1)
        if self.context_parallel is not None or layout.params.cp is not None:  # a CP shard
            o_THV = cp_latent_attention(self.context_parallel, q, kv_TC, self._expand, layout, self.window,
                                        self.scale, self.backend)
        else:
            k, v = self._expand(kv_TC)
            o_THV = attend(q, k, v, layout, self.window, self.scale, self.backend)
        return self.o_proj(o_THV.reshape(T, H * self.v_head_dim))

    def _expand(self, kv_RC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows ``[R, kv_lora_rank + rope]`` -> ``k [R, heads, nope + rope]``, ``v [R, heads, v_head_dim]``."""
        R, H = kv_RC.shape[0], self.num_heads
        latent_RC, k_rot = kv_RC.split([self.kv_lora_rank, self.rope], -1)
        kv = self.kv_b_proj(latent_RC).view(R, H, self.nope + self.v_head_dim)
        k_nope, v = kv.split([self.nope, self.v_head_dim], -1)
        return torch.cat([k_nope, k_rot[:, None, :].expand(R, H, self.rope)], -1), v
