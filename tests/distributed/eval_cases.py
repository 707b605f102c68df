"""Rank-side body of the evaluation layout tests (importable by spawned processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from core.parallel_state import ParallelSizes, ParallelState
from models.step37 import Step37Model
from training.parallelize import parallelize
from tests.distributed.parallel_cases import micro_batches, run_args, settings, tiny_config
from training.evaluate import forward_only


def reference_loss(cfg, batches) -> tuple[float, int]:
    """One process, every micro-batch of every DP rank: main-head loss per target token."""
    model = Step37Model(cfg, seed=0)
    loss_sum, n = 0.0, 0
    with torch.no_grad():
        for b in (b for row in batches for b in row):
            out = model(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
            loss_sum += float(out.loss_sum)
            n += int(out.num_tokens)
    return loss_sum / n, n


def check_eval_layout(rank, world, pp, vpp, ep, M=None):
    """The forward-only pipeline's validation loss on this layout equals one process's.
    Tolerance 1e-5 relative: the same fp32 token losses summed in another order (~1e-7)."""
    cfg = tiny_config()
    sizes = ParallelSizes(world, pp=pp, ep=ep, vpp=vpp)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    M = M or max(2, pp)
    batches = micro_batches(sizes.dp, M, cfg.vocab_size, seed=3)
    want, n = reference_loss(cfg, batches)
    chunks = parallelize(cfg, ps, run_args(pp, vpp, ep))
    loss_sum, num_tokens, *_ = forward_only(chunks, ps, batches[ps.dp_rank], settings(cfg))
    t = torch.stack([loss_sum, num_tokens.double()])
    dist.all_reduce(t)
    got, got_n = float(t[0] / t[1]), int(t[1])
    assert got_n == n, (got_n, n)
    assert abs(got - want) <= 1e-5 * abs(want), (rank, got, want)
    assert all(p.grad is None for c in chunks for p in c.parameters()), "evaluation made gradients"
    dist.barrier()
