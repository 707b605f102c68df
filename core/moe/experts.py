"""Routed experts with weights stacked ``[E, out, in]`` (the published layout), run as one
grouped GEMM over tokens sorted by expert (``torch.nn.functional.grouped_mm``) or, where that is
unavailable or the shapes are not 16-byte aligned, a loop over the experts' segments. The forward
is identical whether the E experts are all of them (EP = 1) or this rank's share."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.transformer.mlp import clamped_swiglu


def _contiguous_grad(y: torch.Tensor) -> torch.Tensor:
    """Make the gradient arriving at ``y`` contiguous (grouped_mm's backward needs it). A hook,
    not an identity autograd Function: that would return a view, which FSDP warns about."""
    if y.requires_grad:
        y.register_hook(lambda g: g.contiguous())
    return y


def _segment_matmul(x_NI: torch.Tensor, w_EIO: torch.Tensor, offs: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]``: one grouped GEMM, or a loop over the
    segments (which reads the segment sizes on the host)."""
    if grouped:
        return F.grouped_mm(x_NI, w_EIO, offs=offs)
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
    chunks = torch.split(x_NI, sizes)
    return torch.cat([c @ w_EIO[e] for e, c in enumerate(chunks)], dim=0) if chunks else \
        x_NI.new_zeros(0, w_EIO.shape[-1])


@torch.library.custom_op("moe::expert_matmul", mutates_args=())
def _expert_matmul(x_NI: torch.Tensor, w_EIO: torch.Tensor, offs: torch.Tensor, grouped: bool) -> torch.Tensor:
    """:func:`_segment_matmul` as an opaque op, for compiled graphs where the traced
    ``grouped_mm`` does not apply: fp32 (torch's tracing rule for grouped_mm admits only bf16,
    while the CPU kernel runs fp32) and the loop (fp32 on CUDA), whose host read of the segment
    sizes then happens inside the op instead of breaking the graph."""
    return _segment_matmul(x_NI, w_EIO, offs, grouped)


@_expert_matmul.register_fake
def _(x_NI, w_EIO, offs, grouped):
    return x_NI.new_empty(x_NI.shape[0], w_EIO.shape[-1])


@torch.library.custom_op("moe::expert_matmul_backward", mutates_args=())
def _expert_matmul_backward(g_NO: torch.Tensor, x_NI: torch.Tensor, w_EIO: torch.Tensor,
                            offs: torch.Tensor, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.func: plain autograd is switched off inside a custom op's implementation
    _, vjp = torch.func.vjp(lambda x, w: _segment_matmul(x, w, offs, grouped), x_NI, w_EIO)
    return vjp(g_NO.contiguous())


@_expert_matmul_backward.register_fake
def _(g_NO, x_NI, w_EIO, offs, grouped):
    return torch.empty_like(x_NI), torch.empty_like(w_EIO)


def _expert_matmul_setup(ctx, inputs, output):
    x, w, offs, grouped = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.grouped = grouped


def _expert_matmul_grad(ctx, g_NO):
    x, w, offs = ctx.saved_tensors
    return (*_expert_matmul_backward(g_NO, x, w, offs, ctx.grouped), None, None)


_expert_matmul.register_autograd(_expert_matmul_grad, setup_context=_expert_matmul_setup)


def _grouped_mm_ok(x: torch.Tensor, *dims: int) -> bool:
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return all((d * x.element_size()) % 16 == 0 for d in dims)


def expert_linear(x_NI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor,
                  use_grouped: bool) -> torch.Tensor:
    """Row block ``e`` of ``x`` (``counts[e]`` rows, in expert order) times ``w[e].T``."""
    # offloaded (FSDP CPU offload) weights come to the compute device here, differentiably
    w_EOI = w_EOI.to(x_NI.device)
    offs = torch.cumsum(counts_E, 0).to(torch.int32)
    if torch.compiler.is_compiling() and not (use_grouped and x_NI.dtype == torch.bfloat16):
        return _expert_matmul(x_NI, w_EOI.transpose(-2, -1), offs, use_grouped)
    out = _segment_matmul(x_NI, w_EOI.transpose(-2, -1), offs, use_grouped)
    return _contiguous_grad(out) if use_grouped else out


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, limit: float | None = None,
                 expert_offset: int = 0):
        super().__init__()
        self.num_experts, self.limit = num_experts, limit
        self.expert_offset = expert_offset  # global index of this module's first expert
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.use_grouped_mm = True

    def forward(self, x_NH: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """``x`` rows sorted by expert, ``counts[e]`` of them for expert ``e``."""
        grouped = self.use_grouped_mm and _grouped_mm_ok(x_NH, *self.gate_proj.shape[1:])
        gate = expert_linear(x_NH, self.gate_proj, counts_E, grouped)
        up = expert_linear(x_NH, self.up_proj, counts_E, grouped)
        return expert_linear(clamped_swiglu(gate, up, self.limit), self.down_proj, counts_E, grouped)
