"""Rank-side bodies of the storage-mode tests: --bf16 with fp32 masters against
--store-param-remainders and --optimizer-in-backward, each alone and together, same layout,
same batches; and a resume of each."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from core.model_api import specs_of
from core.optim.build import build_optimizer
from core.optim.in_backward import InBackwardSteps
from core.optim.masters import masters_of
from core.parallel_state import ParallelSizes, ParallelState
from core.train_step import train_step
from core.transformer.block import pending_grads
from tests.distributed.parallel_cases import micro_batches, run_args, settings, tiny_config
from training.parallelize import parallelize

MODES = {"bf16": (), "remainders": ("--store-param-remainders",), "in_backward": ("--optimizer-in-backward",),
         "both": ("--store-param-remainders", "--optimizer-in-backward"),
         "host": ("--cpu-offload", "masters"), "host_in_backward": ("--cpu-offload", "masters", "--optimizer-in-backward")}
CHUNKED = ("--recompute-granularity", "full", "--recompute-chunks", "2", "--micro-batch-size", "2")  # a pack at a time
CHUNK_MODES = {"chunks": CHUNKED, "host_in_backward_chunks": (*MODES["host_in_backward"], *CHUNKED,
                                                              "--offload-recompute-inputs")}
OVERLAP_MODES = {"overlap": ("--overlap-moe-expert-parallel-comm",)}  # resumed only (needs EP > 1)


def optim_cfg(optimizer: str, momentum: float = 0.0):
    # eps 1 makes AdamW's update smooth in the gradient (at 1e-8 its first steps are ~lr * sign(g):
    # a 1e-7 difference in a near-zero gradient entry becomes a full step of the other sign);
    # Newton-Schulz in fp32 (in bf16 two inputs one rounding apart give updates 2e-2 apart)
    return SimpleNamespace(optimizer=optimizer, lr=1e-2 if optimizer == "muon" else 1e-1, adamw_lr=1e-1,
                           weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1.0, muon_momentum=momentum,
                           muon_nesterov=True, muon_ns_steps=5, muon_ns_method="quintic", muon_lr_adjust="rms",
                           muon_ns_dtype="fp32", dion_momentum=0.9, dion_rank_fraction=0.5)


def build(cfg, ps, ep: int, mode: str, optimizer: str, momentum: float = 0.0):
    flags = ["--bf16", "--data-parallel-sharding", "fsdp", *{**MODES, **CHUNK_MODES, **OVERLAP_MODES}[mode]]
    chunks = parallelize(cfg, ps, run_args(1, 1, ep, *flags))
    opt, _ = build_optimizer(chunks, optim_cfg(optimizer, momentum))
    if "--optimizer-in-backward" in flags and optimizer == "muon":
        opt.in_backward = InBackwardSteps(opt.optimizers["muon"], specs_of(chunks), ps, pending_grads(chunks))
    return chunks, opt


def masters(chunks) -> dict:
    """This rank's fp32 master of every parameter (its rows), by name."""
    m = masters_of(chunks)
    return {n: m.master(p).clone() for c in chunks for n, p in c.named_parameters()}


def train(chunks, opt, ps, cfg, steps: int, clip: float, first: int = 0, packs: int = 1) -> list:
    out = []
    for s in range(first, steps):
        batches = micro_batches(ps.sizes.dp, 1, cfg.vocab_size, seed=100 + s, packs=packs)[ps.dp_rank]
        out.append(train_step(chunks, ps, opt, batches, settings(cfg, clip_grad=clip)))
    return out


def compare_modes(rank, world, ep, optimizer, clip, steps, tolerance, modes=tuple(MODES), packs=1):
    """Every mode's (of ``modes``: --bf16 and others) masters after ``steps`` steps against
    --bf16's, as the largest difference relative to how far each tensor moved (0: bitwise), and
    its losses; ``tolerance``: mode -> (masters, losses) allowed; micro-batches of ``packs`` packs."""
    cfg = tiny_config()
    ps = ParallelState.build(ParallelSizes(world, ep=ep), cfg.num_layers, cfg.num_experts)
    runs = {}
    for mode in ("bf16", *(m for m in modes if m != "bf16")):
        chunks, opt = build(cfg, ps, ep, mode, optimizer)
        init = masters(chunks)
        losses = [m.loss for m in train(chunks, opt, ps, cfg, steps, clip, packs=packs)]
        runs[mode] = (init, losses, masters(chunks))
    init, ref_losses, ref = runs["bf16"]
    for mode, (_, losses, got) in runs.items():
        errs = [float((got[n] - ref[n]).abs().max() / (ref[n] - init[n]).abs().max().clamp(min=1e-30))
                for n in ref if ref[n].numel()]
        t = torch.tensor([max(errs, default=0.0), max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))],
                         dtype=torch.float64)
        if dist.is_initialized() and world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        allowed = tolerance.get(mode, (0.0, 0.0))
        assert t[0] <= allowed[0] and t[1] <= allowed[1], \
            f"{mode}: masters {t[0]:.2e} of their movement, losses {t[1]:.2e} relative from --bf16's (allowed {allowed})"


def resume_is_bitwise(rank, world, ep, mode, optimizer, tmpdir, momentum=0.0):
    """Four steps straight, or two, a checkpoint (fp32 masters, the optimizer's state), a fresh
    build loaded from it and two more: the same masters and losses, bit for bit. ``momentum``:
    Muon's (0: only AdamW's moments, on the non-matrix parameters, are state to resume)."""
    from core.checkpoint.sharded import load_checkpoint, save_checkpoint

    cfg = tiny_config()
    ps = ParallelState.build(ParallelSizes(world, ep=ep), cfg.num_layers, cfg.num_experts)
    chunks, opt = build(cfg, ps, ep, mode, optimizer, momentum)
    assert any(getattr(m, "overlap_moe", False) for c in chunks for m in c.modules()) == (mode in OVERLAP_MODES)
    straight = [m.loss for m in train(chunks, opt, ps, cfg, 4, 1.0)]
    want = masters(chunks)
    chunks, opt = build(cfg, ps, ep, mode, optimizer, momentum)
    first = [m.loss for m in train(chunks, opt, ps, cfg, 2, 1.0)]
    save_checkpoint(f"{tmpdir}/ck", 2, chunks, opt, {}, {"model": cfg.to_dict()})
    chunks, opt = build(cfg, ps, ep, mode, optimizer, momentum)
    load_checkpoint(f"{tmpdir}/ck", chunks, opt)
    rest = [m.loss for m in train(chunks, opt, ps, cfg, 4, 1.0, first=2)]
    assert first + rest == straight, (first + rest, straight)
    got = masters(chunks)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
