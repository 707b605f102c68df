"""Runs one rank's part of a pipeline schedule: forward/backward of micro-batches on its model
chunks, with fixed-shape ``[T, hidden]`` point-to-point transfers of activations and their
gradients.

Every stage builds micro-batch ``m`` itself (``get_batch(m)``: tokens, position ids, packed
sequence metadata, labels), so only hidden states cross stages, and they always have the
same shape: no shape exchange, no metadata on the wire. The transfers follow the plan of
``core/pipeline/p2p.py``: batches of ``batch_isend_irecv``, issued in the plan's order,
deadlock-free under NCCL's in-order matching (proven by ``nccl_replay``; the executor records
what it issues in ``trace`` so tests replay the real thing). A batch is not waited on when it is
issued: the executor computes on, and waits (in issue order, as NCCL completes them) only when
an action needs a tensor it receives, so a rank never idles for a neighbour's message it does
not need yet. A sent activation's buffer and values are released as soon as its batch is seen
complete (polled before every action, at the latest at the next wait).

The objective is ``(sum of main + MTP token losses) / num_tokens`` with ``num_tokens`` the
step's global target count (all micro-batches, all data-parallel ranks), plus ``aux_coeff``
times each micro-batch's MoE aux loss averaged over micro-batches and DP ranks. Each chunk's
forward returns a ``StageOutput`` (``core/model_api.py``); the executor sums its losses and its
MoE routing load over the step's micro-batches.

A model-wide aux loss (``core.moe.aux``, scope ``model``: router statistics averaged over every
MoE layer of the model, as transformers computes it) needs the statistics of every stage. With
``carry_numel`` (experts + 1) they travel with the pipeline's messages: each activation carries
the routed-slot counts and MoE-layer count of the stages before it, each gradient carries the
micro-batch's totals back, so every stage adds exactly its share ``coeff * E / (L n)^2 *
counts . probs_stage`` of the loss (its gradient) at its backward. The carry is one more tensor
after each message's own in the same ``batch_isend_irecv``, on both sides, so NCCL's in-order
matching still pairs the right tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from core.distributed.fsdp import set_gradient_sync
from core.moe.aux import model_aux_share
from core.packed_seq import ImageInputs
from core.parallel_state import ParallelState
from core.pipeline.p2p import P2POp, plan_all
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
                 aux_coeff: float = 0.0, carry_numel: int = 0, nan_on_nonfinite_loss: bool = False,
                 idle_vision: bool = True):
        """``idle_vision``: a first-stage micro-batch without images gets ``ImageInputs.idle()`` (a
        vision tower runs idle, its collectives in step with a data-parallel rank that has images);
        False when no rank of the stage's data-parallel group has an image this step
        (``core/train_step.py``): it gets none, and the tower does not run."""
        self.chunks, self.ps = chunks, pstate
        self.idle_vision = idle_vision
        # optimizer in backward: a non-finite loss makes every gradient NaN, so no matrix steps
        self.nan_on_nonfinite_loss = nan_on_nonfinite_loss
        self.carry_numel = carry_numel if aux_coeff else 0  # router statistics riding on each message
        self.T, self.H, self.dtype, self.device = seq_tokens, hidden_size, dtype, device
        self.mtp_loss_scale, self.aux_coeff = mtp_loss_scale, aux_coeff
        self.pp, self.vpp = pstate.sizes.pp, len(chunks)
        self.num_stages = self.pp * self.vpp
        self.p2p_bytes = 0       # bytes this rank has sent point to point (activations and grads)
        self.trace: list = []    # every batch issued, as P2POp lists (for the NCCL replay)
        self.peak_held_bytes = 0  # most activation bytes the executor referenced after an action
        self._saved: dict = {}   # (micro-batch, chunk) -> (input, output, aux) until its backward
        self._inbox: dict = {}   # message label -> received tensor, until its action consumes it
        self._outbox: dict = {}  # message label -> (tensor to send, (micro-batch, chunk) or None, carry)
        self._carries: dict = {}  # message label -> the carry received with it
        self._inflight: list = []  # issued batches not yet seen complete: (works, batch), oldest first
        self._trainable = [_trainable(c) for c in chunks]  # per chunk: (text, image-only) counts

    # ------------------------------------------------------------------ p2p
    def _exchange(self, batch: list[P2POp]) -> None:
        """Issue one planned batch as one ``batch_isend_irecv``, in the plan's order."""
        ops, issued = [], []
        for op in batch:
            if op.op == "send":
                t, _, carry = self._outbox[op.label]
                tensors = [t, carry] if self.carry_numel else [t]
            else:
                t = self._inbox[op.label] = torch.empty(self.T, self.H, dtype=self.dtype, device=self.device)
                tensors = [t]
                if self.carry_numel:
                    tensors.append(torch.empty(self.carry_numel, dtype=torch.float32, device=self.device))
                    self._carries[op.label] = tensors[1]
            for x in tensors:  # the message, then its carry: the same order on both sides
                if op.op == "send":
                    self.p2p_bytes += x.numel() * x.element_size()
                ops.append(dist.P2POp(dist.isend if op.op == "send" else dist.irecv, x, op.peer))
                issued.append(P2POp(op.op, op.peer, op.label, tuple(x.shape), str(x.dtype)))
        self.trace.append(issued)
        self._inflight.append((dist.batch_isend_irecv(ops), batch))

    def _retire(self, need=None, everything: bool = False) -> None:
        """Retire issued batches in issue order: those already complete, then, if a batch still
        in flight receives message ``need`` (or ``everything``), wait until that one is."""
        while self._inflight:
            works, batch = self._inflight[0]
            must = everything or any(op.op == "recv" and op.label == need for _, b in self._inflight
                                     for op in b)
            if not must and not all(w.is_completed() for w in works):
                return
            for w in works:
                w.wait()  # on GPU: the compute stream waits for NCCL's, the host does not
            self._inflight.pop(0)
            for op in batch:
                if op.op == "send":
                    _, owner, _ = self._outbox.pop(op.label)
                    if owner is not None:  # a stage output: backward needs its node, not its values
                        _free_values(self._saved[owner][1])

    def held_bytes(self) -> int:
        """Bytes of the distinct tensors the executor references (saved stage inputs and
        outputs, received and unsent buffers); autograd's own saved tensors are not counted."""
        tensors = [t for v in self._saved.values() for t in v if torch.is_tensor(t)]
        tensors += list(self._inbox.values()) + [t for t, _, _ in self._outbox.values()]
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}  # by StorageImpl
        return sum(storages.values())

    # ------------------------------------------------------------------ steps
    def run(self, schedule: list[list[Action]], get_batch: Callable[[int], object], num_tokens: int,
            num_microbatches_global: int) -> StepStats:
        """Execute this rank's part of ``schedule`` (every pipeline rank's action list, so the
        communication plan is the same on all of them); gradients accumulate in the chunks'
        parameters.

        ``num_tokens``: global main-head target count of the step (all-reduced by the caller).
        ``num_microbatches_global``: micro-batches over all DP ranks (for the aux average).
        A schedule of forwards only (evaluation) runs without autograd: nothing is kept for a
        backward, and a sent output is dropped when its batch is retired.
        """
        if not any(a.kind == "B" for acts in schedule for a in acts):
            with torch.no_grad():
                return self._run(schedule, get_batch, num_tokens, num_microbatches_global)
        return self._run(schedule, get_batch, num_tokens, num_microbatches_global)

    def _run(self, schedule, get_batch, num_tokens: int, num_microbatches_global: int) -> StepStats:
        program = plan_all(schedule, self.ps.ranks("pp"))[self.ps.rank] if self.pp > 1 else schedule[0]
        actions = [a for a in program if isinstance(a, Action)]
        # FSDP: reduce-scatter gradients only on each chunk's last backward of the step
        last_backward = {a.chunk: i for i, a in enumerate(actions) if a.kind == "B"}
        stats = StepStats(torch.zeros((), dtype=torch.float64, device=self.device),
                          torch.zeros((), dtype=torch.int64, device=self.device))
        i = 0
        for item in program:
            if not isinstance(item, Action):
                self._exchange(item)
                continue
            a, stage = item, item.chunk * self.pp + self.ps.pp_rank
            need = ("F", a.microbatch, stage) if a.kind == "F" else ("B", a.microbatch, stage)
            self._retire(need)
            if a.kind == "F":
                saved = self._forward(a, stage, get_batch(a.microbatch), num_tokens, num_microbatches_global, stats)
                if torch.is_grad_enabled():  # evaluation keeps nothing for a backward
                    self._saved[(a.microbatch, a.chunk)] = saved
            else:
                set_gradient_sync(self.chunks[a.chunk], last_backward[a.chunk] == i)
                self._backward(a, stage, self._saved.pop((a.microbatch, a.chunk)))
            i += 1
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes())
        self._retire(everything=True)
        assert not (self._saved or self._inbox or self._outbox or self._carries), \
            "pipeline step ended with tensors in flight"
        return stats

    def _forward(self, a: Action, stage: int, batch, num_tokens: int, n_mb: int, stats: StepStats):
        model = self.chunks[a.chunk]
        last = stage == self.num_stages - 1
        inp = None if stage == 0 else self._inbox.pop(("F", a.microbatch, stage))
        if inp is not None and torch.is_grad_enabled():
            inp.requires_grad_()
        # a micro-batch's images (image + text packs) go to the first stage only; without any, an
        # idle ImageInputs when the tower must run its collectives (see __init__); a text-only
        # step of the whole group makes the same call as before images existed
        images = getattr(batch, "images", None) if stage == 0 else None
        text, image_only = self._trainable[a.chunk]
        reached = text + (image_only if images is not None else 0)  # an idle tower reaches no loss
        if images is None and stage == 0 and self.idle_vision:
            images = ImageInputs.idle(self.device)
        out = model(batch.tokens, batch.position_ids, batch.packed_seq_params, hidden=inp,
                    labels=batch.labels, **({"images": images} if images is not None else {}))
        stats.add(a.chunk, out)
        carry, router = self._carry(stage, a.microbatch, out, n_mb)
        aux = None
        if self.aux_coeff and out.aux_loss is not None and router is None:
            aux = self.aux_coeff * out.aux_loss / n_mb  # this chunk's own (per-layer) aux loss
        if last:
            loss = out.loss_sum + self.mtp_loss_scale * sum(out.mtp_loss_sums)
            total = loss / num_tokens + (aux if aux is not None else 0.0)
            if router is not None:  # the micro-batch's totals are known here: add this stage's share
                total = total + router(carry)
            if self.nan_on_nonfinite_loss:  # x 1.0 when finite (exact); NaN gradients otherwise
                total = total * torch.where(torch.isfinite(total.detach()), 1.0, float("nan"))
            _check_reached(total, reached, stage)
            return inp, total, None, None, carry
        _check_reached(out.hidden, reached, stage)
        buf = out.hidden.detach().to(self.dtype).contiguous()
        owner = (a.microbatch, a.chunk) if torch.is_grad_enabled() else None
        self._outbox[("F", a.microbatch, stage + 1)] = (buf, owner, carry)
        return inp, out.hidden, aux, router, None

    def _carry(self, stage: int, microbatch: int, out, n_mb: int):
        """``(carry to send on, this stage's share of the model-wide aux loss as a function of the
        micro-batch's totals, or None)``: the counts of the stages so far plus this one's."""
        if not self.carry_numel:
            return None, None
        carry = self._carries.pop(("F", microbatch, stage)) if stage > 0 else \
            torch.zeros(self.carry_numel, dtype=torch.float32, device=self.device)
        if out.router_counts is None:
            return carry, None
        own = torch.cat([out.router_counts.detach().float(), carry.new_full((1,), float(out.router_layers))])
        probs, tokens, coeff = out.router_probs, out.router_tokens, self.aux_coeff / n_mb
        return carry + own, lambda totals: coeff * model_aux_share(totals[:-1], probs, totals[-1], tokens)

    def _backward(self, a: Action, stage: int, saved) -> None:
        inp, out, aux, router, carry = saved
        if stage == self.num_stages - 1:
            if out.requires_grad:  # a frozen stage (LoRA without adapters here) has no backward
                out.backward()
        else:
            grad = self._inbox.pop(("B", a.microbatch, stage)).to(out.dtype)
            tensors, grads = [out], [grad]
            carry = self._carries.pop(("B", a.microbatch, stage)) if self.carry_numel else None
            if router is not None:
                aux = router(carry) if aux is None else aux + router(carry)
            if aux is not None:
                tensors.append(aux)
                grads.append(torch.ones_like(aux))
            # a first stage with no trainable parameter (a LoRA base without adapters there)
            # has nothing to differentiate
            keep = [i for i, t in enumerate(tensors) if t.requires_grad]
            # the engine directly: `out` may be a freed placeholder whose shape no longer matches
            if keep:
                torch.autograd.Variable._execution_engine.run_backward(
                    tuple(tensors[i] for i in keep), tuple(grads[i] for i in keep), False, False, (), True, True)
        if inp is not None:
            self._outbox[("B", a.microbatch, stage - 1)] = (inp.grad.contiguous(), None, carry)


def _trainable(chunk) -> tuple[int, int]:
    """``(trainable parameters, those of them only images reach)`` of a chunk (host facts)."""
    image = {id(p) for p in (chunk.image_parameters() if hasattr(chunk, "image_parameters") else [])}
    flags = [id(p) in image for p in chunk.parameters() if p.requires_grad]
    return len(flags) - sum(flags), sum(flags)


def _check_reached(out: torch.Tensor, trainable: int, stage: int) -> None:
    """A stage whose output needs no gradient although the micro-batch reaches ``trainable``
    parameters would train nothing, silently (its backward is skipped): a custom autograd
    Function hid them. ``requires_grad`` is a host fact: no device read."""
    if trainable and torch.is_grad_enabled() and not out.requires_grad:
        raise RuntimeError(f"pipeline stage {stage}: the output needs no gradient but reaches {trainable} trainable "
                           "parameters, so nothing would train; seen with a frozen embedding (--lora-rank, "
                           "--freeze-language) and --recompute-chunks / --offload-recompute-inputs: report it "
                           "with this run's flags")


def _free_values(out: torch.Tensor) -> None:
    """Drop a sent stage output's values, keep its autograd node (Megatron's pseudo-deallocation).

    Backward of the residual add that ends a stage needs no values of its output, so once the
    send of the ``[T, hidden]`` output completes its storage is released instead of living until
    this micro-batch's backward; with 1F1B that is up to ``pp`` buffers per rank."""
    if type(out.grad_fn).__name__ == "AddBackward0":
        out.data = torch.empty(1, dtype=out.dtype, device=out.device)
