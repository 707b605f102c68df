"""Evaluation: validation loss and perplexity, forward only through the pipeline, on any layout.

A forward-only schedule is each rank's forward actions of the training schedule, in their
order (``forward_only_schedule``); the training executor runs it without autograd, with the
same NCCL-safe communication plan, keeping nothing for a backward. Every stage builds the
micro-batch itself, as in training; the last stage sums token losses and target counts,
reduced over the world once per evaluation.

Evaluating changes nothing the training reads: no gradient, no optimizer or router-bias
update, its own loader, and the RNG state restored afterwards. FSDP units gathered for the
forwards are resharded at the end.

With ``--num-workers N`` the validation micro-batches come through the same path as the
training ones (``data/prefetch.MicroBatchFeed``: built in N worker processes, images decoded
there, pinned on CUDA), over the evaluation's fixed range: the workers start at each evaluation,
build nothing past its last micro-batch, and stop when it ends (no process and no prefetched
batch held between evaluations). The batches are the training thread's, bit for bit.
"""
from __future__ import annotations

import math
import time

import torch

from core.distributed.fsdp import reshard
from core.distributed.grads import reduce_step_metrics
from core.parallel_state import ParallelState, local_device
from core.pipeline.executor import PipelineExecutor
from core.pipeline.schedules import Action, build_schedule
from core.train_step import StepSettings
from data.prefetch import MicroBatchFeed


def forward_only_schedule(pp: int, vpp: int, num_microbatches: int) -> list[list[Action]]:
    """Every pipeline rank's forward actions, in the order its training schedule runs them."""
    return [[a for a in acts if a.kind == "F"] for acts in build_schedule(pp, vpp, num_microbatches)]


def forward_only(chunks: list, ps: ParallelState, batches: list, s: StepSettings) -> list:
    """Forwards of ``batches`` (this DP rank's host micro-batches) through the pipeline executor
    without autograd: ``[loss sum, target count, *MTP loss sums]`` of this rank (zeros off the
    last stage). Collective over the pipeline (and the EP group inside MoE layers)."""
    device = s.device or local_device()
    on_device = [b.to(device) for b in batches]
    executor = PipelineExecutor(chunks, ps, seq_tokens=on_device[0].tokens.numel(), hidden_size=s.hidden_size,
                                dtype=s.dtype, device=device)
    stats = executor.run(forward_only_schedule(ps.sizes.pp, ps.sizes.vpp, len(batches)), on_device.__getitem__,
                         num_tokens=1, num_microbatches_global=len(batches) * ps.sizes.dp)
    zero = stats.loss_sum.new_zeros(())
    return [stats.loss_sum, stats.num_tokens, *(stats.mtp_loss_sums or [zero] * s.mtp_depths)]


def evaluate(chunks: list, ps: ParallelState, loader, num_microbatches: int, eval_iters: int,
             s: StepSettings, num_workers: int = 0) -> dict:
    """Validation metrics over ``eval_iters`` global batches: the loader's first
    ``eval_iters * num_microbatches`` micro-batches on this DP rank (the same ones every call),
    built in ``num_workers`` worker processes (0: here). Collective over the world; every rank
    gets the same numbers."""
    t0 = time.perf_counter()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    total = None
    position = loader.consumed
    loader.consumed = 0
    feed = MicroBatchFeed(loader, num_workers, end=eval_iters * num_microbatches)
    try:
        for _ in range(eval_iters):
            batches = [next(feed) for _ in range(num_microbatches)]
            parts = forward_only(chunks, ps, batches, s)
            total = parts if total is None else [a + b for a, b in zip(total, parts)]
    finally:
        feed.close()
        loader.consumed = position
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
