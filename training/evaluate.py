"""Evaluation: validation loss and perplexity, forward only through the pipeline, on any layout.

A forward-only schedule is each rank's forward actions of the training schedule, in their
order (``forward_only_schedule``); ``core.pipeline.p2p.plan_all`` turns it into the same kind of
program the training executor runs: actions and batches of ``batch_isend_irecv``. Here each
batch is waited on as soon as it is issued, which the plan allows (it is deadlock-free even if
every operation blocks until matched); no activation is kept for a backward, so a rank holds
at most the ``[T, hidden]`` buffers of one round. Every stage builds the micro-batch itself, as
in training; the last stage sums token losses and target counts, reduced over the world once
per evaluation.

Evaluating changes nothing the training reads: no gradient, no optimizer or router-bias
update, its own loader, and the RNG state restored afterwards. FSDP units gathered for the
forwards are resharded at the end.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from core.distributed.fsdp import reshard
from core.distributed.grads import reduce_step_metrics
from core.parallel_state import ParallelState, local_device
from core.pipeline.p2p import plan_all
from core.pipeline.schedules import Action, build_schedule
from core.train_step import StepSettings


def forward_only_schedule(pp: int, vpp: int, num_microbatches: int) -> list[list[Action]]:
    """Every pipeline rank's forward actions, in the order its training schedule runs them."""
    return [[a for a in acts if a.kind == "F"] for acts in build_schedule(pp, vpp, num_microbatches)]


@dataclass
class ForwardSums:
    loss_sum: torch.Tensor   # main-head token-loss sum over this rank's micro-batches (fp64)
    num_tokens: torch.Tensor  # main-head targets over this rank's micro-batches
    mtp_loss_sums: list      # per MTP depth


def forward_only(chunks: list, ps: ParallelState, batches: list, s: StepSettings) -> ForwardSums:
    """Forwards of ``batches`` (this DP rank's micro-batches, any device) through the pipeline,
    without autograd. Collective over the pipeline (and the EP group inside MoE layers)."""
    device = s.device or local_device()
    pp, vpp = ps.sizes.pp, len(chunks)
    schedule = forward_only_schedule(pp, vpp, len(batches))
    program = plan_all(schedule, ps.ranks("pp"))[ps.rank] if pp > 1 else schedule[0]
    T, last = batches[0].tokens.numel(), pp * vpp - 1
    sums = ForwardSums(torch.zeros((), dtype=torch.float64, device=device),
                       torch.zeros((), dtype=torch.int64, device=device),
                       [torch.zeros((), dtype=torch.float64, device=device)] * s.mtp_depths)
    inbox, outbox = {}, {}
    with torch.no_grad():
        for item in program:
            if not isinstance(item, Action):  # one planned batch: issue, then wait for all of it
                ops = []
                for op in item:
                    if op.op == "send":
                        ops.append(dist.P2POp(dist.isend, outbox.pop(op.label), op.peer))
                    else:
                        inbox[op.label] = torch.empty(T, s.hidden_size, dtype=s.dtype, device=device)
                        ops.append(dist.P2POp(dist.irecv, inbox[op.label], op.peer))
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                continue
            stage = item.chunk * pp + ps.pp_rank
            b = batches[item.microbatch].to(device)
            hidden = None if stage == 0 else inbox.pop(("F", item.microbatch, stage))
            out = chunks[item.chunk](b.tokens, b.position_ids, b.packed_seq_params, hidden=hidden,
                                     labels=b.labels)
            if stage == last:
                sums.loss_sum += out.loss_sum.double()
                sums.num_tokens += out.num_tokens
                sums.mtp_loss_sums = [x + y.double() for x, y in zip(sums.mtp_loss_sums, out.mtp_loss_sums)]
            else:
                outbox[("F", item.microbatch, stage + 1)] = out.hidden.to(s.dtype).contiguous()
    assert not inbox and not outbox, "forward-only pipeline ended with messages in flight"
    return sums


def evaluate(chunks: list, ps: ParallelState, loader, num_microbatches: int, eval_iters: int,
             s: StepSettings) -> dict:
    """Validation metrics over ``eval_iters`` global batches: the loader's first
    ``eval_iters * num_microbatches`` micro-batches on this DP rank (the same ones every call).
    Collective over the world; every rank gets the same numbers."""
    t0 = time.perf_counter()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    total = None
    try:
        for k in range(eval_iters):
            batches = [loader.micro_batch(k * num_microbatches + m) for m in range(num_microbatches)]
            sums = forward_only(chunks, ps, batches, s)
            parts = [sums.loss_sum, sums.num_tokens, *sums.mtp_loss_sums]
            total = parts if total is None else [a + b for a, b in zip(total, parts)]
    finally:
        reshard(chunks)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    loss_sum, n, *mtp = reduce_step_metrics(total)
    n = max(n, 1.0)
    loss = loss_sum / n
    return {"valid_loss": loss, "valid_ppl": math.exp(min(20.0, loss)),  # capped as Megatron does
            "valid_mtp_loss": sum(mtp) / n / len(mtp) if mtp else None,
            "valid_targets": int(n), "eval_ms": 1000 * (time.perf_counter() - t0)}
