"""Runs one rank's action list: forward/backward of micro-batches on its model chunks, with
fixed-shape ``[T, hidden]`` point-to-point transfers of activations and their gradients.

Every stage builds micro-batch ``m`` itself (``get_batch(m)``: tokens, position ids, packed
sequence metadata, labels), so only hidden states cross stages, and they always have the
same shape: no shape exchange, no metadata on the wire. Sends are non-blocking and receives
carry a tag naming (kind, micro-batch, stage), so any schedule the simulator accepts runs
without deadlock. The objective is ``(sum of main + MTP token losses) / num_tokens`` with
``num_tokens`` the step's global target count (all micro-batches, all data-parallel ranks),
plus ``aux_coeff`` times each MoE layer's aux loss averaged over micro-batches and DP ranks.
Each chunk's forward returns a ``StageOutput`` (``core/model_api.py``); the executor sums its
losses and its MoE routing load over the step's micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from core.distributed.fsdp import set_gradient_sync
from core.parallel_state import ParallelState
from core.pipeline.schedules import Action


@dataclass
class StepStats:
    loss_sum: torch.Tensor      # main-head token-loss sum over this rank's micro-batches
    num_tokens: torch.Tensor    # main-head targets over this rank's micro-batches
    mtp_loss_sums: list = field(default_factory=list)
    expert_load: dict = field(default_factory=dict)  # chunk -> [moe layers, experts] tokens, summed

    def add(self, chunk: int, out) -> None:
        if out.expert_load is not None:
            load = out.expert_load.detach()
            self.expert_load[chunk] = self.expert_load[chunk] + load if chunk in self.expert_load else load
        if out.loss_sum is None:
            return
        self.loss_sum += out.loss_sum.detach().double()
        self.num_tokens += out.num_tokens
        sums = self.mtp_loss_sums or [0.0] * len(out.mtp_loss_sums)
        self.mtp_loss_sums = [x + y.detach().double() for x, y in zip(sums, out.mtp_loss_sums)]


class PipelineExecutor:
    def __init__(self, chunks: list, pstate: ParallelState, *, seq_tokens: int, hidden_size: int,
                 dtype: torch.dtype = torch.float32, device="cpu", mtp_loss_scale: float = 0.0,
                 aux_coeff: float = 0.0):
        self.chunks, self.ps = chunks, pstate
        self.T, self.H, self.dtype, self.device = seq_tokens, hidden_size, dtype, device
        self.mtp_loss_scale, self.aux_coeff = mtp_loss_scale, aux_coeff
        self.pp, self.vpp = pstate.sizes.pp, len(chunks)
        self.num_stages = self.pp * self.vpp
        self.p2p_bytes = 0  # bytes this rank has sent point to point (activations and grads)

    # ------------------------------------------------------------------ p2p
    def _tag(self, kind: str, m: int, stage: int) -> int:
        return (m * self.num_stages + stage) * 2 + (kind == "B")

    def _recv(self, kind: str, m: int, stage: int, src: int) -> torch.Tensor:
        buf = torch.empty(self.T, self.H, dtype=self.dtype, device=self.device)
        dist.recv(buf, src=src, tag=self._tag(kind, m, stage))
        return buf

    def _send(self, t: torch.Tensor, kind: str, m: int, stage: int, dst: int) -> None:
        buf = t.detach().to(self.dtype).contiguous()
        self.p2p_bytes += buf.numel() * buf.element_size()
        self._pending.append(dist.isend(buf, dst=dst, tag=self._tag(kind, m, stage)))

    # ------------------------------------------------------------------ steps
    def run(self, actions: list[Action], get_batch: Callable[[int], object], num_tokens: int,
            num_microbatches_global: int) -> StepStats:
        """Execute ``actions``; gradients accumulate in the chunks' parameters.

        ``num_tokens``: global main-head target count of the step (all-reduced by the caller).
        ``num_microbatches_global``: micro-batches over all DP ranks (for the aux average).
        """
        self._pending: list = []
        saved: dict = {}
        # FSDP: reduce-scatter gradients only on each chunk's last backward of the step
        last_backward = {a.chunk: i for i, a in enumerate(actions) if a.kind == "B"}
        stats = StepStats(torch.zeros((), dtype=torch.float64, device=self.device),
                          torch.zeros((), dtype=torch.int64, device=self.device))
        for i, a in enumerate(actions):
            stage = a.chunk * self.pp + self.ps.pp_rank
            if a.kind == "F":
                saved[(a.microbatch, a.chunk)] = self._forward(a, stage, get_batch(a.microbatch),
                                                               num_tokens, num_microbatches_global, stats)
            else:
                set_gradient_sync(self.chunks[a.chunk], last_backward[a.chunk] == i)
                self._backward(a, stage, saved.pop((a.microbatch, a.chunk)))
        for w in self._pending:
            w.wait()
        return stats

    def _forward(self, a: Action, stage: int, batch, num_tokens: int, n_mb: int, stats: StepStats):
        model = self.chunks[a.chunk]
        first, last = stage == 0, stage == self.num_stages - 1
        inp = None
        if not first:
            inp = self._recv("F", a.microbatch, stage, self.ps.pp_peer(-1)).requires_grad_()
        out = model(batch.tokens, batch.position_ids, batch.packed_seq_params, hidden=inp,
                    labels=batch.labels)
        stats.add(a.chunk, out)
        aux = self.aux_coeff * out.aux_loss / n_mb if self.aux_coeff and out.aux_loss is not None else None
        if last:
            loss = out.loss_sum + self.mtp_loss_scale * sum(out.mtp_loss_sums)
            return inp, loss / num_tokens + (aux if aux is not None else 0.0), None
        self._send(out.hidden, "F", a.microbatch, stage + 1, self.ps.pp_peer(1))
        _free_values(out.hidden)
        return inp, out.hidden, aux

    def _backward(self, a: Action, stage: int, saved) -> None:
        inp, out, aux = saved
        if stage == self.num_stages - 1:
            out.backward()
        else:
            grad = self._recv("B", a.microbatch, stage, self.ps.pp_peer(1)).to(out.dtype)
            tensors, grads = [out], [grad]
            if aux is not None:
                tensors.append(aux)
                grads.append(torch.ones_like(aux))
            # the engine directly: `out` may be a freed placeholder whose shape no longer matches
            torch.autograd.Variable._execution_engine.run_backward(
                tuple(tensors), tuple(grads), False, False, (), True, True)
        if inp is not None:
            self._send(inp.grad, "B", a.microbatch, stage - 1, self.ps.pp_peer(-1))


def _free_values(out: torch.Tensor) -> None:
    """Drop a sent stage output's values, keep its autograd node (Megatron's pseudo-deallocation).

    Backward of the residual add that ends a stage needs no values of its output, so the
    ``[T, hidden]`` buffer is released as soon as the send completes instead of living until
    this micro-batch's backward; with 1F1B that is up to ``pp`` buffers per rank."""
    if type(out.grad_fn).__name__ == "AddBackward0":
        out.data = torch.empty(1, dtype=out.dtype, device=out.device)
