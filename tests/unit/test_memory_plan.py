"""The memory planner against what the tiny model really allocates."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core.costs.saved_bytes import SavedTensorBytes
from core.optim.build import build_optimizer
from core.parallel_state import ParallelSizes, ParallelState
from models.step37 import Step37Config
from core.costs.activations import cpu_sdpa_extra_bytes
from models.registry import shapes_of
from tests.planner_inputs import inputs
from training.planner.memory import _chunk_activations, placement, plan
from training.parallelize import build_chunks
from training.planner.shares import rank_shares
from tests.unit.test_model_hf import thd
from tests.unit.test_model_thd import labels_for


def _optim_args(optimizer, momentum):
    return SimpleNamespace(optimizer=optimizer, lr=0.01, adamw_lr=None, weight_decay=0.1, adam_beta1=0.9,
                           adam_beta2=0.95, adam_eps=1e-8, muon_momentum=momentum, muon_nesterov=True,
                           muon_ns_steps=5, muon_ns_method="quintic", muon_lr_adjust="rms",
                           dion_momentum=0.9, dion_rank_fraction=0.25)


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("optimizer, momentum", [("adamw", 0.0), ("muon", 0.95), ("muon", 0.0), ("dion", 0.0)])
def test_parameter_gradient_and_optimizer_bytes_are_exact(optimizer, momentum):
    cfg = Step37Config.preset("tiny")
    inp = inputs(pp=2, ep=2, dp=2, optimizer=optimizer, muon_momentum=momentum)
    planned = {(r.pp_rank, r.ep_rank): r for r in plan(cfg, inp)}
    sizes = ParallelSizes(4, pp=2, ep=2)
    for (pp, ep), r in planned.items():
        chunks = build_chunks(cfg, ParallelState(sizes, sizes.rank_of(dp=ep, pp=pp), {}), seq_length=inp.seq_length)
        params = [p for c in chunks for p in c.parameters()]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt, _ = build_optimizer(chunks, _optim_args(optimizer, momentum))
        opt.step()
        assert r.device["parameters"] == _bytes(params)
        assert r.device["gradients"] == _bytes(p.grad for p in params)
        assert r.device["optimizer"] == opt.state_bytes(), (pp, ep)


def test_activation_estimate_within_25_percent_of_measurement():
    cfg = Step37Config.preset("tiny")
    docs = [100, 100, 56]
    chunk = build_chunks(cfg, ParallelState.single())[0]
    tokens, pos, psp = thd(docs)
    with SavedTensorBytes(chunk) as saved:
        chunk(tokens, pos, psp, labels=labels_for(tokens, docs))
    inp = inputs()
    estimate = _chunk_activations(cfg, chunk, 256, 4, inp)
    # what CPU SDPA keeps on top of a fused GPU kernel (the planner assumes one)
    shapes = shapes_of(cfg)
    blocks = shapes.blocks + shapes.extra
    windows = [x.attention.window for x in blocks]  # layers of one window share one mask
    estimate += sum(cpu_sdpa_extra_bytes(x.attention, docs, 4, windows.count(x.attention.window)) for x in blocks)
    assert 0.75 <= estimate / saved.bytes <= 1.25, (estimate, saved.bytes)


def test_flash_on_8_gpus_fits_only_with_optimizer_offload():
    """PP4 x EP2 under --bf16 (fp32 master weights and gradients): without offload no split fits
    141 GB (the even one, 11, 12, 11, 11, nor the default cost-balanced one). Offloading the
    shards (all) does not fit either: between micro-batches FSDP keeps every unit's unsharded
    gradient in fp32 on the device (4 bytes x 33.4e9 parameters on pp1 = 133.5 GB). With
    ``--cpu-offload optimizer`` gradients sync on every backward, so only the stage's bf16
    compute copy (2 bytes per parameter) stays on the device and it fits."""
    cfg = Step37Config.preset("step37-flash")
    common = dict(pp=4, ep=2, dp=2, seq_length=8192, num_microbatches=32, optimizer="muon",
                  muon_momentum=0.0, recompute_granularity="full", bf16=True)
    plain = plan(cfg, inputs(**common, pipeline_layout="11,12,11,11"))
    assert not all(r.fits for r in plain) and not all(r.fits for r in plan(cfg, inputs(**common)))
    assert sum(r.parameters for r in plain if r.ep_rank == 0) + \
        sum(r.parameters for r in plain if r.ep_rank == 1) > 196e9  # experts split, dense replicated

    offload = plan(cfg, inputs(**common, data_parallel_sharding="fsdp", cpu_offload="all"))
    pp1 = offload[2]
    # expert-DP is 1, so each rank's experts are whole: shards = whole stage but dense halves
    stage_numel = sum(t.t.numel() for c in rank_shares(cfg, 4, 1, 2, None, 8192)[1] for t in c.tensors)
    assert pp1.device["unsharded grads"] == 4 * stage_numel and 133e9 < 4 * stage_numel < 134e9
    assert pp1.device["parameters"] == pp1.device["gradients"] == 0 and not pp1.fits

    opt = plan(cfg, inputs(**common, data_parallel_sharding="fsdp", cpu_offload="optimizer"))
    assert all(r.fits for r in opt)
    for r, chunks in zip(opt[::2], rank_shares(cfg, 4, 1, 2, None, 8192)):
        numel = sum(t.t.numel() for c in chunks for t in c.tensors)
        routers = sum(t.t.numel() for c in chunks for t in c.tensors if t.fp32)
        assert r.device["gathered layers"] == 2 * numel + 2 * routers  # bf16 copy, fp32 routers
        assert r.device["parameters"] == r.device["gradients"] == r.device["optimizer"] == 0
        assert r.host["parameters"] == r.host["gradients"] == 4 * r.parameters


def test_inputs_are_validated():
    with pytest.raises(ValueError, match="--cpu-offload needs --data-parallel-sharding fsdp"):
        inputs(cpu_offload="all")
    with pytest.raises(ValueError, match="--recompute-granularity 'some': expected one of none, selective, full"):
        inputs(recompute_granularity="some")
    with pytest.raises(ValueError, match="--optimizer 'sgdx': expected one of adamw, muon"):
        inputs(optimizer="sgdx")  # the registry's own error


def test_inputs_hold_the_mode_and_the_options_not_copies():
    """``PlanInputs`` takes and reads the memory flags through its ``MemoryMode`` and the
    optimizer's options through its ``OptimOptions`` only: no flag-named keywords or attributes."""
    from training.planner.inputs import PlanInputs

    for flag in ("recompute", "sharding", "cpu_offload", "optimizer", "muon_momentum"):
        with pytest.raises(TypeError):
            PlanInputs(**{flag: None})
        assert not hasattr(PlanInputs(), flag), flag


# ---------------------------------------------------------------- FSDP against real allocations
FSDP_CASES = {  # name: (sharding, cpu_offload, bf16, optimizer, muon momentum, gather once)
    "fsdp_fp32_offload_all_adamw": ("fsdp", "all", False, "adamw", 0.0, False),
    "fsdp_bf16_offload_experts_muon": ("fsdp", "experts", True, "muon", 0.9, False),
    "fsdp_bf16_gather_once_muon": ("fsdp", "none", True, "muon", 0.0, True),
    "one_rank_meshes_bf16_adamw": ("none", "none", True, "adamw", 0.0, False),
    "fsdp_bf16_offload_optimizer_muon": ("fsdp", "optimizer", True, "muon", 0.9, False),
}


def _fsdp_params(chunk):
    """FSDP2's per-parameter records (private API: the only place its accumulators live)."""
    from torch.distributed.fsdp import FSDPModule

    from core.distributed.fsdp_internals import fsdp_params

    return [fp for m in chunk.modules() if isinstance(m, FSDPModule) for fp in fsdp_params(m)]


def _check_fsdp_bytes(rank, world, sharding, offload, bf16, optimizer, momentum, once):
    """Two micro-batches, gradient sync off for the first (as the executor does): after it the
    unsharded accumulators are what the planner books as "unsharded grads" (none under
    ``--cpu-offload optimizer``, which reduces on every backward); after the second
    (synchronising) one the shards' gradients are the "gradients"; then parameters and
    optimizer state, split into device and host by FSDP's own offload flag."""
    from core.distributed.fsdp import apply_fsdp, reshard, set_gradient_sync
    from core.distributed.grads import local

    cfg = Step37Config.preset("tiny")
    sizes = ParallelSizes(world, pp=1, ep=1)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    inp = inputs(dp=world, data_parallel_sharding=sharding, cpu_offload=offload, bf16=bf16, optimizer=optimizer,
                 muon_momentum=momentum, num_microbatches=2, seq_length=64, fsdp_gather_once=once)
    planned = plan(cfg, inp)[0]
    chunk = build_chunks(cfg, ps, seq_length=64)[0]
    assert apply_fsdp(chunk, ps, placement(inp), "cpu")
    docs = [40, 24]
    tokens, pos, psp = thd(docs, seed=rank)
    for sync in (False, True):
        set_gradient_sync(chunk, sync)
        out = chunk(tokens, pos, psp, labels=labels_for(tokens, docs))
        (out.loss_sum + sum(out.mtp_loss_sums)).backward()
        if not sync:
            accumulated = [f.unsharded_accumulated_grad if f.unsharded_accumulated_grad is not None
                           else f._unsharded_param.grad for f in _fsdp_params(chunk)]
            accumulated = [g for g in accumulated if g is not None]
            if placement(inp).sync_every_microbatch:  # "optimizer": reduced, nothing outlives it
                assert not accumulated and planned.device["unsharded grads"] > 0  # one unit's, transient
            else:
                assert _bytes(accumulated) == planned.device["unsharded grads"], (rank, sharding, offload)
    if planned.device["gathered layers"] and not placement(inp).gather_per_microbatch:
        # still gathered for the step: the modules hold the compute copies (bf16, fp32 routers)
        assert _bytes(chunk.parameters()) == planned.device["gathered layers"]
    reshard([chunk])  # as train_step does after the optimizer step: the modules hold the shards
    on_host = {id(f.sharded_param) for f in _fsdp_params(chunk) if f.offload_to_cpu}
    params = list(chunk.parameters())
    host = [local(p) for p in params if id(p) in on_host]
    dev = [local(p) for p in params if id(p) not in on_host]
    assert (_bytes(dev), _bytes(host)) == (planned.device["parameters"], planned.host["parameters"]), \
        (_bytes(dev), _bytes(host), planned.device, planned.host)
    grads = [(id(p) in on_host, local(p.grad)) for p in params]
    assert _bytes(g for h, g in grads if not h) == planned.device["gradients"]
    assert _bytes(g for h, g in grads if h) == planned.host["gradients"]
    opt, _ = build_optimizer([chunk], _optim_args(optimizer, momentum))
    opt.step()
    # this rank's shards of the state (CompositeOptimizer.state_bytes counts DTensors whole)
    state = [local(t) for o in opt.optimizers.values() for st in o.state.values() for t in st.values()
             if torch.is_tensor(t)]
    assert _bytes(state) == planned.device["optimizer"] + planned.host["optimizer"], \
        (_bytes(state), opt.state_bytes(), planned.device["optimizer"], planned.host["optimizer"])


def _fsdp_cases(rank, world):
    for case in FSDP_CASES.values():
        _check_fsdp_bytes(rank, world, *case)


def test_fsdp_gradients_parameters_and_optimizer_bytes_are_exact(tmp_path):
    """On 2 gloo ranks (tiny model, DP 2): the unsharded fp32 accumulators FSDP keeps while
    sync is off (whatever the offload mode), and the sharded parameters, gradients and
    optimizer state on device and host, byte for byte as planned, also under --bf16 and
    --cpu-offload optimizer."""
    from tests.distributed.harness import run_ranks

    run_ranks(2, _fsdp_cases, tmpdir=str(tmp_path), timeout=240)


def test_cp2_keeps_its_shards_activations_and_the_key_buffers_by_hand():
    """CP2 (tiny model, 64 tokens, fp32): a rank's activations are those of 32 tokens at CP1;
    on top (cp K/V) each full layer keeps its key buffer of (1 + 1/4) x 64 = 80 rows of K and V
    (256 bytes a row) and each sliding layer (2, and 2 MTP depths) its 32 rows and a halo of at
    most 14: 2 x 20,480 + 4 x 11,776 = 88,064 bytes, plus one full layer's gathered 64 rows
    (16,384) while its buffer is cut from them. Full recompute keeps no key buffer."""
    from models.step37 import Step37Config

    cfg = Step37Config.preset("tiny")
    base = dict(pp=1, dp=1, seq_length=64, num_microbatches=2, optimizer="adamw")
    cp2 = plan(cfg, inputs(cp=2, **base))[0]
    half = plan(cfg, inputs(**{**base, "seq_length": 32}))[0]
    assert cp2.device["activations"] == half.device["activations"]
    assert cp2.device["cp K/V"] == 88_064 + 16_384 and half.device["cp K/V"] == 0
    assert plan(cfg, inputs(cp=2, recompute_granularity="full", **base))[0].device["cp K/V"] == 16_384
    with pytest.raises(ValueError, match="--seq-length 66 must be a multiple of 2 x --context-parallel-size = 8"):
        inputs(cp=4, **{**base, "seq_length": 66})


def _units_bytes(block, router_fp32: bool) -> tuple[int, int, int]:
    """(outer, router, experts) gathered bytes of a decoder block's FSDP units under bf16, counted
    from its modules (``fsdp_units``: the experts and the fp32 router are inner units)."""
    from core.moe.experts import GroupedExperts
    from core.moe.router import TopKRouter

    experts = sum(p.numel() for m in block.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
    router = sum(p.numel() for m in block.modules() if isinstance(m, TopKRouter) for p in m.parameters())
    router = router if router_fp32 else 0
    return sum(p.numel() for p in block.parameters()) * 2 - experts * 2 - router * 2, router * 4, experts * 2


@pytest.mark.parametrize("chunks", [1, 2])
def test_gathered_blocks_are_the_units_fsdp2s_backward_holds_at_once(chunks):
    """FSDP2's default backward prefetch gathers the block below's outer unit at the pre-backward
    of the block's router (the unit whose forward ended before the block's first), once its
    experts are freed: an MoE block's backward holds itself whole, then itself less its experts
    with the outer unit below; under --recompute-chunks its pre-backward gathers its inner units
    and the block below's outer unit together. The plan booked two whole blocks (the largest
    twice), experts and all."""
    from training.planner.memory import gathered_blocks

    cfg = Step37Config.preset("tiny")
    inp = inputs(dp=2, ep=1, data_parallel_sharding="fsdp", bf16=True, recompute_granularity="full",
                 recompute_chunks=chunks, seq_length=64, micro_batch_size=2, num_microbatches=1)
    pl = placement(inp)
    assert pl.managed["expert"] and pl.bf16  # expert-DP 2: the experts are an inner unit
    share = rank_shares(cfg, 1, 1, 1, None, 64)[0][0]
    chunk = build_chunks(cfg, ParallelState(ParallelSizes(1), 0, {}), None, seq_length=64, device="meta")[0]
    blocks = dict(chunk.blocks())
    order = [*share.layers, *sorted((k for k in blocks if k < 0), reverse=True)]
    want, below = {}, 0
    for k in order:
        o, r, e = _units_bytes(blocks[k], chunk.router_fp32)
        want[k] = o + r + e + below if chunks > 1 else max(o + r + e, o + (r or e) + below)
        below = o
    assert gathered_blocks(share, inp, pl) == want
    moe = [k for k in order if _units_bytes(blocks[k], chunk.router_fp32)[2]]
    assert moe and all(want[k] < 2 * max(want.values()) for k in moe)
    if chunks == 1:  # the plan's column without recompute working sets: the most of them, and the root in
        # the forward and (one stage per rank: it is freed once the heads' backward is done) beside
        # an MTP depth's backward
        from dataclasses import replace

        none = replace(inp, mode=replace(inp.mode, recompute_granularity="none"))
        r = plan(cfg, none)[0]
        root = sum(t.t.numel() for t in share.tensors if t.block is None) * 2
        back = max([*(w for k, w in want.items() if k >= 0), *(w + root for k, w in want.items() if k < 0)])
        assert r.device["gathered layers"] == max(back, max(want.values()) + root - r.device["unsharded grads"])
        assert r.device["gathered layers"] < 2 * max(want.values()) + root  # two of the largest: the old booking
