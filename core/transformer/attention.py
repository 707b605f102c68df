"""GQA self-attention on THD input, with the options families use: per-head RMSNorm on q and k
before RoPE (``qk_norm``, in either RMSNorm form), an optional sliding window, projection biases
(``bias`` on q/k/v and, unless ``o_bias`` says otherwise, on ``o_proj``: GLM-4.5 biases q/k/v
only), and an optional head-wise sigmoid gate on each head's output before ``o_proj`` (Step-3.x's
``g_proj``: hidden -> one gate per head).

:func:`attend` is the one kernel call every attention kind makes (this GQA module and
``core/transformer/mla.py``): the backend, the compiled path or the context-parallel exchange.
It takes a value head dim different from the query/key head dim: ``sdpa`` computes with it as it
is; a kernel that needs equal dims (flash ``varlen``, ``flex``, Transformer Engine, the compiled
op, the CP exchange) gets V zero-padded to the query/key dim and its output cropped back, as
transformers does for flash attention. The padding is exact (zero value columns add nothing to
the columns kept) but costs the padded columns' FLOPs and bytes.

Every attention kind declares what core's machinery reads from it (:func:`attention_modules`
finds them), so a new kind needs no edit in ``core/finetune/lora.py``, ``core/compile.py`` or
``core/context_parallel/apply.py``:

- ``lora_projections``: the names of its linears that ``--lora-targets attention`` adapts, in
  that order (one a configuration leaves out, a gate or a low-rank query, is skipped);
- ``backend``: the kernel it calls :func:`attend` with (``--compile`` checks it);
- ``supports_context_parallel``: whether ``apply_context_parallel`` may give it the CP group
  (its ``context_parallel``, passed on to :func:`attend`); one that cannot is refused by name."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.context_parallel.attention import cp_attention
from core.transformer.attention_backends import BACKENDS, DocLayout, resolve_backend
from core.transformer.attention_op import compiled_attention
from core.transformer.norm import RMSNorm
from core.transformer.rotary import apply_rotary


def is_attention(m: nn.Module) -> bool:
    """Whether ``m`` is an attention kind of core's: it declares the protocol above
    (``lora_projections``), whatever its class."""
    return isinstance(getattr(type(m), "lora_projections", None), tuple)


def attention_modules(module: nn.Module) -> list[nn.Module]:
    """The attention modules inside ``module`` (itself included)."""
    return [m for m in module.modules() if is_attention(m)]


class Attention(nn.Module):
    lora_projections = ("q_proj", "k_proj", "v_proj", "o_proj", "g_proj")  # the protocol above
    supports_context_parallel = True
    context_parallel = None  # core.context_parallel.ContextParallel, set by apply_context_parallel

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 window: int | None, softmax_scale: float, eps: float, backend: str = "auto",
                 gate: bool = False, qk_norm: bool = True, norm_offset: bool = True, bias: bool = False,
                 o_bias: bool | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window, self.scale, self.backend = window, softmax_scale, backend
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=bias if o_bias is None else o_bias)
        self.g_proj = nn.Linear(hidden, num_heads, bias=False) if gate else None  # one gate per head
        self.q_norm = RMSNorm(head_dim, eps, offset=norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, offset=norm_offset) if qk_norm else None

    def forward(self, x_TH: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                layout: DocLayout) -> torch.Tensor:
        T = x_TH.shape[0]
        q = self.q_proj(x_TH).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x_TH).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_TH).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o_THD = attend(q, k, v, layout, self.window, self.scale, self.backend, self.context_parallel)
        if self.g_proj is not None:
            o_THD = o_THD * torch.sigmoid(self.g_proj(x_TH)).unsqueeze(-1)
        return self.o_proj(o_THD.reshape(T, self.num_heads * self.head_dim))


NATIVE_VALUE_DIM = ("sdpa",)  # backends that take a value head dim other than the query/key one


def attend(q, k, v, layout: DocLayout, window: int | None, scale: float, backend: str = "auto",
           context_parallel=None) -> torch.Tensor:
    """Causal THD attention of ``q``/``k [T, H, D]`` over ``v [T, Hkv, Dv]`` -> ``[T, Hq, Dv]``:
    the context-parallel exchange on a CP shard, the compiled op inside a compiled layer, else
    the backend (``auto``: sdpa in fp32, flash needs 16-bit). ``Dv != D``: see the module
    docstring (V padded to ``D`` where the kernel needs equal dims, the output cropped)."""
    backend = resolve_backend(backend, q.device, q.dtype)
    cp = context_parallel is not None or layout.params.cp is not None  # a CP shard
    compiling = torch.compiler.is_compiling()  # inside a compiled layer: boundaries as tensors
    dv = v.shape[-1]
    if dv != q.shape[-1] and (cp or compiling or backend not in NATIVE_VALUE_DIM):
        if dv > q.shape[-1]:  # zero q/k dims add nothing to q.k (the scale is passed as it is)
            q, k = (F.pad(t, (0, dv - t.shape[-1])) for t in (q, k))
        else:
            v = F.pad(v, (0, q.shape[-1] - dv))
    if cp:
        o_THD = cp_attention(context_parallel, q, k, v, layout, window, scale, backend)
    elif compiling:
        o_THD = compiled_attention(q, k, v, layout, window, scale, backend)
    else:
        o_THD = BACKENDS[backend](q, k, v, layout, window, scale)
    return o_THD if o_THD.shape[-1] == dv else o_THD[..., :dv]
