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


@torch.library.custom_op("step37::grouped_mm_fp32", mutates_args=())
def _grouped_mm_fp32(x_NI: torch.Tensor, w_EIO: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm`` as an opaque op, for compiled graphs in fp32 on CPU: torch's own
    tracing rule for grouped_mm only admits bf16, while the CPU kernel runs fp32."""
    return F.grouped_mm(x_NI, w_EIO, offs=offs)


@_grouped_mm_fp32.register_fake
def _(x_NI, w_EIO, offs):
    return x_NI.new_empty(x_NI.shape[0], w_EIO.shape[-1])


@torch.library.custom_op("step37::grouped_mm_fp32_backward", mutates_args=())
def _grouped_mm_fp32_backward(g_NO: torch.Tensor, x_NI: torch.Tensor, w_EIO: torch.Tensor,
                              offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # torch.func: plain autograd is switched off inside a custom op's implementation
    _, vjp = torch.func.vjp(lambda x, w: F.grouped_mm(x, w, offs=offs), x_NI, w_EIO)
    return vjp(g_NO.contiguous())


@_grouped_mm_fp32_backward.register_fake
def _(g_NO, x_NI, w_EIO, offs):
    return torch.empty_like(x_NI), torch.empty_like(w_EIO)


def _grouped_mm_fp32_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_fp32_grad(ctx, g_NO):
    x, w, offs = ctx.saved_tensors
    return (*_grouped_mm_fp32_backward(g_NO, x, w, offs), None)


_grouped_mm_fp32.register_autograd(_grouped_mm_fp32_grad, setup_context=_grouped_mm_fp32_setup)


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
    if use_grouped:
        offs = torch.cumsum(counts_E, 0).to(torch.int32)
        if torch.compiler.is_compiling() and x_NI.dtype != torch.bfloat16:
            return _grouped_mm_fp32(x_NI, w_EOI.transpose(-2, -1), offs)
        return _contiguous_grad(F.grouped_mm(x_NI, w_EOI.transpose(-2, -1), offs=offs))
    chunks = torch.split(x_NI, counts_E.tolist())
    return torch.cat([c @ w_EOI[e].T for e, c in enumerate(chunks)], dim=0) if chunks else \
        x_NI.new_zeros(0, w_EOI.shape[1])


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
