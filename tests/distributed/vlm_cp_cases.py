"""Rank-side body of the VLM context-parallel test: CP2 (plain, and FSDP2 over the dp x cp ranks
with full recompute) against one unsharded process, three clipped-SGD steps over the same image +
text packs: loss, grad norm and every gradient at every step.

Each CP rank encodes all its micro-batch's images and writes the features of the placeholders
its shard holds (``data/cp_shard.py``). The packs make both cases the design must get right:

* a document whose image run is cut by the CP chunk boundary (the load-balanced 2 x cp chunks
  put parts of one image on both ranks: of its 12 placeholders, at pack positions 5..16, rank 0
  holds the first, in its chunk 0..5, and rank 1 the other 11, in its chunks 6..17);
* a pack whose image tokens all lie in CP rank 0's chunks: rank 1's shard holds none, gets no
  images and runs the idle pass, which under FSDP must issue the same gathers and
  reduce-scatters as rank 0's real pass (else the step hangs)."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from core.context_parallel.shard import shard_positions
from core.packed_seq import PackedSeqParams
from core.parallel_state import ParallelSizes, ParallelState
from core.train_step import train_step
from data.cp_shard import shard_batch, shard_images
from data.thd import THDBatch
from models.step37 import Step37Config, Step37Model
from tests.distributed.parallel_cases import global_params, rel_err, run_args, settings
from tests.unit.test_vlm_model import CROP, GLOBAL, IMG, documents, image_inputs, labels_of
from training.parallelize import parallelize

CP, STEPS, SEQ = 2, 3, 64
LR, MOMENTUM = 0.5, 0.9


def _pack(docs) -> THDBatch:
    """One THD pack of SEQ tokens, each document padded to a multiple of 2 x CP (as context
    parallelism packs them), the trailing pad folded into the last document."""
    tokens = torch.zeros(SEQ, dtype=torch.int64)
    labels = torch.full((SEQ,), -100, dtype=torch.int64)
    positions = torch.zeros(SEQ, dtype=torch.int64)
    cu, pad, at = [0], [0], 0
    for i, (t, _) in enumerate(docs):
        width = -(-len(t) // (2 * CP)) * 2 * CP if i < len(docs) - 1 else SEQ - at
        tokens[at:at + len(t)], labels[at:at + len(t)] = t, labels_of(t)
        positions[at:at + width] = torch.arange(width)
        cu.append(cu[-1] + len(t))
        at += width
        pad.append(at)
    assert at == SEQ, at
    psp = PackedSeqParams(torch.tensor(cu, dtype=torch.int32), torch.tensor(pad, dtype=torch.int32),
                          max(len(t) for t, _ in docs))
    images = image_inputs([im for _, ims in docs for im in ims], (tokens == IMG).nonzero()[:, 0])
    return THDBatch(tokens, labels, positions, psp, images)


def _image_on_rank0_only(seed: int) -> list:
    """A 16-token document whose 4-token image (a global view, no crop) fills its first chunk
    (CP rank 0's), then two text-only documents."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(9, 300, (n,), generator=g)
    image = (torch.randn(3, GLOBAL, GLOBAL, generator=g), torch.zeros(0, 3, CROP, CROP))
    return [(torch.cat([torch.full((4,), IMG), text(12)]), [image]), (text(13), []), (text(20), [])]


def _steps() -> list:
    return [[_pack(documents(seed=10 * s)), _pack(_image_on_rank0_only(seed=10 * s + 1)) if s == 0
             else _pack(documents(seed=10 * s + 1))] for s in range(STEPS)]


def _check_packs(steps) -> None:
    """The packs hold what the module docstring promises (host facts, no model)."""
    cut = steps[0][0]
    pad = cut.packed_seq_params.host_boundaries()[1]
    held = [shard_images(cut.images, shard_positions(pad, CP, r)) for r in range(CP)]
    assert all(h is not None for h in held)
    vision = Step37Config.preset("step37-tiny-vlm").vision
    first = cut.images.num_local_patches[0] * vision.features(CROP) + vision.features(GLOBAL)
    run = cut.images.feature_positions[:first]  # the first image's placeholders
    owners = [set(run.tolist()) & set(shard_positions(pad, CP, r).tolist()) for r in range(CP)]
    assert all(owners), "the first image's run is not cut by the CP chunk boundary"
    alone = steps[0][1]
    pad = alone.packed_seq_params.host_boundaries()[1]
    assert shard_images(alone.images, shard_positions(pad, CP, 0)) is not None
    assert shard_images(alone.images, shard_positions(pad, CP, 1)) is None  # rank 1: idle pass


def check_vlm_cp(rank, world, fsdp: bool):
    cfg = Step37Config.preset("step37-tiny-vlm")
    sizes = ParallelSizes(world, cp=CP)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    steps = _steps()
    _check_packs(steps)
    s = settings(cfg)

    ref = Step37Model(cfg, seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    flags = ["--data-parallel-sharding", "fsdp", "--recompute-granularity", "full"] if fsdp else []
    chunks = parallelize(cfg, ps, run_args(1, 1, 1, *flags))
    (chunk,) = chunks
    assert chunk.vision_model is not None
    assert fsdp == any(isinstance(p, DTensor) for p in chunk.vision_model.parameters())
    opt = torch.optim.SGD(chunk.parameters(), lr=LR, momentum=MOMENTUM)
    for step, batches in enumerate(steps):
        ref_opt.zero_grad(set_to_none=True)
        n = sum(int(b.num_target_tokens) for b in batches)
        loss = 0.0
        for b in batches:
            out = ref(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels, images=b.images)
            ((out.loss_sum + s.mtp_loss_scale * sum(out.mtp_loss_sums)) / n).backward()
            loss += float(out.loss_sum.detach())
        ref_norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref.parameters())))
        mine = [shard_batch(b, CP, ps.cp_rank, cfg.num_mtp_layers) for b in batches]
        m = train_step(chunks, ps, opt, mine, s)
        # fp32, the same terms summed in another order: measured loss <= 8.3e-8 and grad norm
        # <= 9.2e-8 relative, every gradient <= 2.4e-6 (the worst a norm weight or the tower's
        # last norm bias at step 3); features mapped to the wrong placeholders moved step 1's
        # loss by 4.5e-4 (tried), a gradient lost or doubled moves a tensor by O(1)
        assert m.num_targets == n and abs(m.loss - loss / n) <= 1e-5 * loss / n, (step, m.loss, loss / n)
        assert abs(m.grad_norm - ref_norm) <= 1e-5 * ref_norm, (step, m.grad_norm, ref_norm)
        want = dict(ref.named_parameters())
        for name, p, ref_p, rows in global_params(chunk, want):
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            err = rel_err(grad, ref_p.grad[rows])
            assert err < 1e-5, f"rank {rank} step {step}: gradient of {name} differs (relative {err:.2e})"
        ref_opt.step()
    dist.barrier()

