"""Rank-side body of the LoRA layout cases (importable by spawned processes): three training steps
of a layout against one process, through the trainer's own ``parallelize`` and ``train_step``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from core.init import local_rows, materialize_seeded
from core.finetune.lora import LoraSettings, apply_lora, base_fingerprint
from core.parallel_state import ParallelSizes, ParallelState
from core.train_step import train_step
from data.cp_shard import shard_batch
from models import registry
from tests.distributed.parallel_cases import MTP_SCALE, micro_batches, rel_err, run_args, settings, tiny_config
from training.parallelize import parallelize

RANK, ALPHA, LR, STEPS = 4, 8.0, 0.5, 3


def lora_reference(cfg, steps: list, lr: float):
    """One process: the whole model with adapters, every micro-batch of every DP rank each step,
    plain SGD on the adapters. Returns the model and the loss per target token of each step."""
    with torch.device("meta"):
        model = registry.spec_of(cfg).build(cfg)
    apply_lora(model, LoraSettings(lora_rank=RANK, lora_alpha=ALPHA))
    materialize_seeded(model, "cpu", seed=0, std=cfg.init_std)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for batches in steps:
        flat = [b for row in batches for b in row]
        n = sum(int(b.num_target_tokens) for b in flat)
        opt.zero_grad()
        total = 0.0
        for b in flat:
            out = model(b.tokens, b.position_ids, b.packed_seq_params, labels=b.labels)
            ((out.loss_sum + MTP_SCALE * sum(out.mtp_loss_sums)) / n).backward()
            total += float(out.loss_sum)
        opt.step()
        losses.append(total / n)
    return model, losses


def check_lora_layout(rank, world, pp, ep, cp=1, flags=(), family="step37"):
    """Three SGD steps on the adapters (B starts at zero, so step 1's update moves B only and
    step 2's moves A too): the layout's loss each step equals one process's within 1e-5 relative
    (the same fp32 terms summed in another order, as in check_layout), its adapters after the
    steps equal the reference's rows within 1e-5, and every frozen base parameter is
    bit-identical to its initial value and has no gradient; the base's fingerprint is one
    process's."""
    cfg = tiny_config(family)
    sizes = ParallelSizes(world, pp=pp, ep=ep, cp=cp)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    M = max(2, pp)
    pad = 2 * cp if cp > 1 else 1
    steps = [micro_batches(sizes.dp, M, cfg.vocab_size, seed=s, pad_multiple=pad) for s in range(STEPS)]
    ref_model, ref_losses = lora_reference(cfg, steps, LR)

    args = run_args(pp, 1, ep, "--context-parallel-size", str(cp), "--lora-rank", str(RANK),
                    "--lora-alpha", str(ALPHA), *flags)
    chunks = parallelize(cfg, ps, args)
    # the frozen base's fingerprint (what a LoRA checkpoint records) is the same in every layout
    assert base_fingerprint(chunks, ps) == base_fingerprint([ref_model])
    base = {(c, n): local_rows(p)[0].clone() for c, chunk in enumerate(chunks)
            for n, p in chunk.named_parameters() if not p.requires_grad}
    trainable = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    assert trainable and base
    opt = torch.optim.SGD(trainable, lr=LR)
    for s, batches in enumerate(steps):
        mine = batches[ps.dp_rank] if cp == 1 else \
            [shard_batch(b, cp, ps.cp_rank, cfg.num_mtp_layers) for b in batches[ps.dp_rank]]
        m = train_step(chunks, ps, opt, mine, settings(cfg))
        assert abs(m.loss - ref_losses[s]) <= 1e-5 * abs(ref_losses[s]), (s, m.loss, ref_losses[s])

    ref = dict(ref_model.named_parameters())
    specs = [chunk.param_specs() for chunk in chunks]
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            local, first = local_rows(p)
            if not local.numel():
                continue
            if not p.requires_grad:
                assert torch.equal(local, base[(c, name)]) and p.grad is None, f"frozen {name} changed"
                continue
            off = specs[c][name].expert_offset or 0
            want = ref[name].detach()[off + first:off + first + local.shape[0]]
            assert rel_err(local, want) < 1e-5, f"rank {rank}: adapter {name} differs ({rel_err(local, want):.2e})"
    dist.barrier()
