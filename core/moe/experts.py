"""Routed experts with weights stacked ``[E, out, in]`` (the published layout), run as one
grouped GEMM over tokens sorted by expert (``torch.nn.functional.grouped_mm``) or, where that is
unavailable, the shapes are not 16-byte aligned or the inputs are fp32 on CUDA (grouped_mm's CUDA
kernel takes bf16; its fallback for other dtypes reads the offsets on the host per call), a loop
over the experts' segments whose sizes are read on the host once per layer. The forward is
identical whether the E experts are all of them (EP = 1) or this rank's share."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.distributed.host_values import host_counts
from core.transformer.mlp import clamped_swiglu


def _contiguous_grad(y: torch.Tensor) -> torch.Tensor:
    """Make the gradient arriving at ``y`` contiguous (grouped_mm's backward needs it). A hook,
    not an identity autograd Function: that would return a view, which FSDP warns about."""
    if y.requires_grad:
        y.register_hook(lambda g: g.contiguous())
    return y


# torch's grouped GEMM: public as F.grouped_mm in newer releases, torch._grouped_mm before
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _segment_matmul(x_NI: torch.Tensor, w_EIO: torch.Tensor, offs: torch.Tensor, grouped: bool,
                    sizes: list | None = None) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]``: one grouped GEMM, or a loop over the
    segments, whose sizes (``sizes``, else read from ``offs`` on the host) it needs as ints."""
    if grouped:
        return _GROUPED_MM(x_NI, w_EIO, offs=offs)
    if sizes is None:
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
    """``dx = g w^T`` and, per expert, ``dw_e = x_e^T g_e`` (zero for an expert with no row),
    written out rather than through ``torch.func.vjp`` (whose wrapped tensors opcheck's modes
    cannot read), so that ``dw`` has the layout of ``w``, as the fake says."""
    g_NO = g_NO.contiguous()
    if grouped:
        dx = _GROUPED_MM(g_NO, w_EIO.transpose(-2, -1), offs=offs)
        dw_EOI = _GROUPED_MM(g_NO.transpose(0, 1), x_NI, offs=offs)
    else:
        sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
        gs, xs = torch.split(g_NO, sizes), torch.split(x_NI, sizes)
        dx = torch.cat([g @ w_EIO[e].T for e, g in enumerate(gs)]) if gs else torch.zeros_like(x_NI)
        dw_EOI = torch.stack([g.T @ x for g, x in zip(gs, xs)]) if gs else \
            torch.zeros_like(w_EIO.transpose(-2, -1))
    dw = dw_EOI.transpose(-2, -1)
    return dx, (dw if dw.stride() == w_EIO.stride() else torch.empty_like(w_EIO).copy_(dw))


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
    if _GROUPED_MM is None or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    return all((d * x.element_size()) % 16 == 0 for d in dims)


def expert_linear(x_NI: torch.Tensor, w_EOI: torch.Tensor, counts_E: torch.Tensor,
                  use_grouped: bool, sizes: list | None = None) -> torch.Tensor:
    """Row block ``e`` of ``x`` (``counts[e]`` rows, in expert order) times ``w[e].T``;
    ``sizes``: the counts as host ints, for the loop (read once per layer by the caller)."""
    # offloaded (FSDP CPU offload) weights come to the compute device here, differentiably
    w_EOI = w_EOI.to(x_NI.device)
    offs = torch.cumsum(counts_E, 0).to(torch.int32)
    if torch.compiler.is_compiling() and not (use_grouped and x_NI.dtype == torch.bfloat16):
        return _expert_matmul(x_NI, w_EOI.transpose(-2, -1), offs, use_grouped)
    out = _segment_matmul(x_NI, w_EOI.transpose(-2, -1), offs, use_grouped, sizes)
    return _contiguous_grad(out) if use_grouped else out


class GroupedExperts(nn.Module):
    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

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
        seg = self._segments(x_NH, counts_E)
        gate = self.project("gate_proj", x_NH, counts_E, seg)
        up = self.project("up_proj", x_NH, counts_E, seg)
        return self.project("down_proj", clamped_swiglu(gate, up, self.limit), counts_E, seg)

    def _segments(self, x_NH: torch.Tensor, counts_E: torch.Tensor):
        """How the layer's projections run: ``(grouped, sizes)``."""
        grouped = self.use_grouped_mm and _grouped_mm_ok(x_NH, *self.gate_proj.shape[1:])
        sizes = None
        if not grouped and not torch.compiler.is_compiling():
            # the loop's segment sizes, read once for the layer's three projections (fp32 on
            # CUDA: one device sync per MoE layer; --bf16 takes grouped_mm, which reads nothing)
            sizes = host_counts(counts_E, x_NH.shape[0])
        return grouped, sizes

    def project(self, name: str, x_NI: torch.Tensor, counts_E: torch.Tensor, segments) -> torch.Tensor:
        """One projection (``name`` in ``PROJECTIONS``) of every expert's rows (a LoRA subclass
        adds its adapters here, ``core/finetune/lora.py``)."""
        grouped, sizes = segments
        return expert_linear(x_NI, getattr(self, name), counts_E, grouped, sizes)
