"""Rank-side body of the FSDP tests: two optimizer steps vs one unsharded process."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from core.distributed.fsdp import ReleaseRootAfterHeads, backward_prefetch_order
from core.distributed.fsdp_internals import backward_prefetch
from core.distributed.grads import clip_gradients
from core.model_api import iter_params
from core.optim.build import build_optimizer
from core.parallel_state import ParallelSizes, ParallelState
from core.train_step import train_step
from models import registry
from training.parallelize import parallelize
from tests.distributed.parallel_cases import (MTP_SCALE, global_params, micro_batches, rel_err, run_args,
                                              settings, tiny_config)

STEPS = 2


def _optim_cfg(optimizer: str):
    # eps 1e-4 keeps AdamW's first steps smooth in the gradient (at 1e-8 they are ~lr * sign(g),
    # which turns summation-order noise in near-zero entries into full steps); NS in fp32
    return SimpleNamespace(optimizer=optimizer, lr=0.01, adamw_lr=None, weight_decay=0.1,
                           adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-4, muon_momentum=0.9,
                           muon_nesterov=True, muon_ns_steps=5, muon_ns_method="quintic",
                           muon_lr_adjust="rms", muon_ns_dtype="fp32", dion_momentum=0.9,
                           dion_rank_fraction=0.5)


def _reference(cfg, batches_per_step, optimizer):
    model = registry.spec_of(cfg).build(cfg, seed=0)
    opt, _ = build_optimizer([model], _optim_cfg(optimizer))
    losses = []
    for batches in batches_per_step:
        flat = [b for row in batches for b in row]
        n = sum(int(b.num_target_tokens) for b in flat)
        total = 0.0
        for b in flat:
            out = model(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
            ((out.loss_sum + MTP_SCALE * sum(out.mtp_loss_sums)) / n).backward()
            total += float(out.loss_sum)
        norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
        clip_gradients(list(model.parameters()), 1.0, norm)
        opt.step()
        opt.zero_grad()
        losses.append(total / n)
    return model, losses


class _CollectiveCounter(dict):
    """Counts FSDP2's all-gathers and reduce-scatters issued inside the block."""

    # what FSDP2 calls: the *_single names in torch 2.13, the *_tensor ones before (2.11)
    NAMES = {"gather": ("all_gather_single", "all_gather_into_tensor"),
             "scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}

    def __enter__(self):
        self._saved = {}
        for role, names in self.NAMES.items():
            n = next(n for n in names if hasattr(dist, n))
            self._saved[n], self[role] = getattr(dist, n), 0
            setattr(dist, n, self._counting(role, self._saved[n]))
        return self

    def _counting(self, name, fn):
        def call(*args, **kwargs):
            self[name] += 1
            return fn(*args, **kwargs)
        return call

    def __exit__(self, *exc):
        for n, fn in self._saved.items():
            setattr(dist, n, fn)


def root_release(chunk):
    """The hook ``apply_fsdp`` attached to the chunk's last decoder layer (None without one)."""
    last = [m for i, m in chunk.blocks() if i >= 0][-1]
    return next((h for h in last._forward_hooks.values() if isinstance(h, ReleaseRootAfterHeads)), None)


def check_fsdp(rank, world, pp, ep, offload, recompute, optimizer, gather_once=False, chunks=1, family="step37",
               config=None, n_steps=STEPS):
    """``chunks`` > 1: micro-batches of that many packs, each recomputed block run a pack at a time
    (``--recompute-chunks``) against the reference's whole micro-batches. ``family`` and
    ``config``: a registered family's tiny preset and overrides of it (``from_hf`` keywords)."""
    cfg = tiny_config(family, **(config or {}))
    sizes = ParallelSizes(world, pp=pp, ep=ep)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    M = max(2, pp)
    steps = [micro_batches(sizes.dp, M, cfg.vocab_size, seed=s, packs=chunks) for s in range(n_steps)]
    ref_model, ref_losses = _reference(cfg, steps, optimizer)

    flags = ["--data-parallel-sharding", "fsdp", "--cpu-offload", offload, "--recompute-granularity",
             recompute] + (["--fsdp-gather-once"] if gather_once else [])
    chunked = chunks > 1
    if chunked:
        flags += ["--recompute-chunks", str(chunks), "--micro-batch-size", str(chunks)]
    chunks = parallelize(cfg, ps, run_args(pp, 1, ep, *flags))
    for chunk in chunks if chunked else []:  # the explicit backward prefetch order reached FSDP
        units = [m for m in chunk.modules() if isinstance(m, FSDPModule)]
        order = backward_prefetch_order(chunk)
        assert any(targets for _, targets in order), order
        assert all(backward_prefetch(u, units) == targets for u, targets in order), order
    released, early = [], pp == 1 and not gather_once and offload != "optimizer"  # "optimizer" gathers once
    if early:  # the root's weights are freed once the heads' backward is done
        chunk, hook = chunks[0], root_release(chunks[0])
        reshard = hook.release
        hook.release = lambda: (reshard(), released.append(isinstance(chunk.head_weight, DTensor)))
    else:
        assert all(root_release(c) is None for c in chunks)
    opt, _ = build_optimizer(chunks, _optim_cfg(optimizer))
    s = settings(cfg, clip_grad=1.0)
    for step, batches in enumerate(steps):
        with _CollectiveCounter() as calls:
            m = train_step(chunks, ps, opt, batches[ps.dp_rank], s)
        if offload == "optimizer":
            # each sharded unit gathers once per step (not per micro-batch and pass) and
            # reduce-scatters on every one of its M backwards (one-rank meshes issue neither)
            gathers = calls["gather"]
            assert gathers > 0 and calls["scatter"] == M * gathers, (dict(calls), M)
        # fp32, the same terms summed in another order: 1e-5 relative leaves ~100x margin
        assert abs(m.loss - ref_losses[step]) <= 1e-5 * ref_losses[step], (step, m.loss, ref_losses[step])

    if early:  # every micro-batch's backward, its head weight sharded again after
        assert released == [True] * (M * n_steps), released
    # 1e-5: the same terms summed in another order; a pack at a time the layers' GEMMs also have
    # other shapes, which moves the hidden states by fp32 roundings: measured <= 1.0e-5 after two
    # steps, largest on the heads (AdamW, fed by those states), against 3e-6 unchunked on the same
    # 2-pack batches; a chunk's gradient lost or doubled moves a tensor by O(1)
    tol = 1e-5 if chunks == 1 else 5e-5
    ref = dict(ref_model.named_parameters())
    sharded = 0
    for chunk in chunks:
        for name, p, want, rows in global_params(chunk, ref):
            sharded += isinstance(p, DTensor)
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            err = rel_err(full, want.detach()[rows])
            assert err < tol, f"rank {rank}: {name} differs after {n_steps} steps (relative {err:.2e})"
    assert sharded > 0
    if offload != "none":  # offloaded shards really live on the host (here: the CPU device)
        experts = {id(p) for _, _, p, spec in iter_params(chunks) if spec.replicated_over == "expert_dp"}
        offloaded = [p for c in chunks for p in c.parameters()
                     if isinstance(p, DTensor) and (offload != "experts" or id(p) in experts)]
        assert offloaded and all(p.to_local().device.type == "cpu" for p in offloaded)
        if offload == "experts":
            assert any(isinstance(p, DTensor) for c in chunks for p in c.parameters() if id(p) in experts)
    dist.barrier()
