"""Rank-side body of the VLM layout tests, two optimizer steps against one process over the same
micro-batches:

* ``fsdp``: two data-parallel ranks, FSDP2 over the vision tower's units (and full recompute,
  the vision layers' included), one rank's
  micro-batches with images and the other's without any: the rank without images still runs
  the tower's gathers and reduce-scatters (its idle pass), so nothing hangs; then a third step
  with no image on either rank: neither runs the tower (no gather, no reduce-scatter on any rank
  of its FSDP group), and its parameters step on a zero gradient as after an idle pass;
* ``pp``: two pipeline stages, the images on the first only (the tower lives there), every
  micro-batch with images."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from core.optim.build import build_optimizer
from core.parallel_state import ParallelSizes, ParallelState
from core.train_step import train_step
from data.thd import THDBatch
from models.step37 import Step37Config, Step37Model
from tests.distributed.fsdp_cases import _optim_cfg
from tests.distributed.parallel_cases import global_params, rel_err, run_args, settings
from tests.unit.test_vlm_model import documents, pack
from training.parallelize import parallelize

STEPS = 2
TEXT_STEP = 2  # fsdp: the step without any image


def _batches(dp_rank: int, step: int, images_everywhere: bool) -> list:
    out = []
    for m in range(2):
        docs = documents(seed=10 * step + 2 * dp_rank + m)
        if (dp_rank == 1 or step == TEXT_STEP) and not images_everywhere:
            docs = [d for d in docs if not d[1]] * 3  # text only: no image on this rank
        tokens, labels, pos, psp, images = pack(docs)
        out.append(THDBatch(tokens, labels, pos, psp, images))
    return out


def check_vlm(rank, world, layout: str):
    cfg = Step37Config.preset("step37-tiny-vlm")
    pp = 2 if layout == "pp" else 1
    sizes = ParallelSizes(world, pp=pp)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    n_steps = STEPS + (layout == "fsdp")
    steps = [[_batches(d, s, layout == "pp") for d in range(sizes.dp)] for s in range(n_steps)]

    ref = Step37Model(cfg, seed=0)
    ref_opt, _ = build_optimizer([ref], _optim_cfg("adamw"))
    s = settings(cfg)
    ref_losses = []
    for batches in steps:
        flat = [b for row in batches for b in row]
        n = sum(int(b.num_target_tokens) for b in flat)
        total = 0.0
        for b in flat:
            out = ref(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels, images=b.images)
            ((out.loss_sum + s.mtp_loss_scale * sum(out.mtp_loss_sums)) / n).backward()
            total += float(out.loss_sum.detach())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)  # a tower not run steps on a zero gradient, as train_step's
        ref_losses.append(total / n)

    flags = ["--data-parallel-sharding", "fsdp", "--recompute-granularity", "full"] if layout == "fsdp" else []
    chunks = parallelize(cfg, ps, run_args(pp, 1, 1, *flags))
    if layout == "fsdp":
        assert any(isinstance(p, DTensor) for p in chunks[0].vision_model.parameters())
    assert (chunks[0].vision_model is not None) == (ps.pp_rank == 0)
    opt, _ = build_optimizer(chunks, _optim_cfg("adamw"))
    tower_runs = []
    if ps.pp_rank == 0:
        chunks[0].vision_model.register_forward_pre_hook(lambda *a: tower_runs.append(1))
    for step, batches in enumerate(steps):
        before = len(tower_runs)
        m = train_step(chunks, ps, opt, batches[ps.dp_rank], s)
        if ps.pp_rank == 0:  # recompute runs the tower's forward again in the backward
            assert (len(tower_runs) == before) == (step == TEXT_STEP and layout == "fsdp"), (step, tower_runs)
        # fp32, the same terms summed in another order
        assert abs(m.loss - ref_losses[step]) <= 1e-5 * ref_losses[step], (step, m.loss, ref_losses[step])
    want = dict(ref.named_parameters())
    for name, p, ref_p, rows in global_params(chunks[0], want):
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        err = rel_err(full, ref_p.detach()[rows])
        # fp32, the same terms summed in another order: measured <= 1.7e-6 on every tensor (the
        # tower's included) but the input embedding, 1.3e-5: rows of rare tokens whose tiny
        # gradients AdamW divides by eps (1e-4), which scales their summation noise ~100x; a
        # gradient lost or doubled on a rank moves a tensor by O(1)
        tol = 5e-5 if name == "embed_tokens.weight" else 1e-5
        assert err < tol, f"rank {rank}: {name} differs after {n_steps} steps (relative {err:.2e})"
    dist.barrier()


def check_vlm_overlap(rank, world):
    """EP2 (the experts split over the two ranks), rank 0's micro-batches with images and rank 1's
    text only, then a step without any image: ``--overlap-moe-expert-parallel-comm`` gives the
    plain schedule's losses over three steps and its first grad norm, AdamW, fp32, 1e-6 relative
    (the chunks' sums in another order: measured 2.5e-8 on the first loss, the later ones equal;
    every tensor's first gradient within 7.4e-7 of its norm, the vision tower's included). The
    later grad norms get 1e-5: AdamW divides gradients far below its eps (1e-4; the tower's are
    ~1e-5) by eps, which lifts that noise into the weights (measured 3.4e-6 on the third); an
    image's tokens lost or given to another document move them by O(1). The tower runs before the
    decoder blocks, on the whole micro-batch; the overlap cuts the embedded sequence (image
    features in place) at a document start, so a document's image tokens stay in its chunk."""
    cfg = Step37Config.preset("step37-tiny-vlm")
    ps = ParallelState.build(ParallelSizes(world, ep=world), cfg.num_layers, cfg.num_experts)
    steps = [_batches(ps.dp_rank, s, False) for s in range(STEPS + 1)]
    assert any(b.images is not None for b in steps[0]) == (ps.dp_rank == 0)
    runs = []
    for flags in ((), ("--overlap-moe-expert-parallel-comm",)):
        chunks = parallelize(cfg, ps, run_args(1, 1, world, *flags))
        assert any(getattr(m, "overlap_moe", False) for m in chunks[0].modules()) == bool(flags)
        opt, _ = build_optimizer(chunks, _optim_cfg("adamw"))
        runs.append([(m.loss, m.grad_norm) for m in (train_step(chunks, ps, opt, b, settings(cfg)) for b in steps)])
    for step, ((a, na), (b, nb)) in enumerate(zip(*runs)):
        print(f"[vlm overlap] step {step}: loss {a!r} vs {b!r}, grad norm {na!r} vs {nb!r}")
        assert abs(a - b) <= 1e-6 * abs(a), (rank, step, a, b)
        assert abs(na - nb) <= (1e-5 if step else 1e-6) * abs(na), (rank, step, na, nb)
    dist.barrier()
