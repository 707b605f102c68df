"""Rank-side bodies of the start-up tests (importable by spawned processes): what ``parallelize``
allocates and writes on each rank, seeded or streamed from a Hugging Face checkpoint."""
from __future__ import annotations

import gc
import json
import os
import resource

import torch
import torch.distributed as dist

from core.parallel_state import ParallelSizes, ParallelState
from models.step37 import Step37Config, Step37Model
from core.checkpoint.hf import READ_BLOCK_BYTES, CheckpointIndex
from core.init import INIT_BLOCK_NUMEL, local_rows, shard_bytes
from training.parallelize import parallelize
from tests.distributed.parallel_cases import global_params, run_args, tiny_config

MiB = 2**20
# Peak RSS during start-up may exceed what the rank holds at the end by the temporaries of one
# step: a seeded block (INIT_BLOCK_NUMEL fp32 values) and its copy, or one block read from the
# checkpoint (mapped file pages, plus a copy for a half of a fused tensor), and 32 MiB for the
# allocator and FSDP's bookkeeping. Measured on the mid-size model: 9-30 MiB above the shards.
ALLOWANCE = max(2 * INIT_BLOCK_NUMEL * 4, 2 * READ_BLOCK_BYTES) + 32 * MiB
PEAK_FACTOR = 1.3  # the bound: peak host memory <= 1.3 x the rank's own shard


def mid_config(**kw) -> Step37Config:
    """About 1B parameters (966 M), the tiny preset's features at width 1024: 80 experts of
    1024, 8 heads of 128, vocabulary 32768."""
    hf = Step37Config.preset("tiny").to_hf()
    hf.update(hidden_size=1024, num_attention_heads=8, num_sliding_attention_heads=8, head_dim=128,
              intermediate_size=4096, moe_intermediate_size=1024, share_expert_dim=2048,
              n_routed_experts=80, vocab_size=32768)
    hf["per_layer_config"] = {k: {"num_attention_heads": 8} for k in hf["per_layer_config"]}
    hf.update(kw)
    return Step37Config.from_hf(hf)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def reset_rss_peak() -> bool:
    """Make ``ru_maxrss`` restart from the current RSS (Linux ``clear_refs`` 5); False where not
    allowed, and the peak then also covers what came before (a looser check)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measured_build(cfg, ps, args) -> tuple[list, dict]:
    """``parallelize`` with this process's memory around it: baseline RSS before, peak RSS
    during, and the bytes of the shards it holds after."""
    gc.collect()
    base, reset = _rss(), reset_rss_peak()
    chunks = parallelize(cfg, ps, args)
    peak = _peak()
    held = shard_bytes(chunks)
    return chunks, {"baseline": base, "peak": peak, "held": held["host"] + held["device"],
                    "peak_reset": reset}


def check_startup_memory(rank, world, pp, ep, flags, out_dir):
    """The mid-size model at this layout: peak RSS <= baseline + 1.3 x shard bytes + ALLOWANCE."""
    cfg = mid_config()
    sizes = ParallelSizes(world, pp=pp, ep=ep)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    chunks, m = measured_build(cfg, ps, run_args(pp, 1, ep, *flags))
    m["parameters"] = sum(local_rows(p)[0].numel() for c in chunks for p in c.parameters())
    with open(os.path.join(out_dir, f"memory{rank}.json"), "w") as f:
        json.dump(m, f)
    bound = m["baseline"] + PEAK_FACTOR * m["held"] + ALLOWANCE
    # the build really allocated and wrote its shards (else the peak says nothing)
    assert m["peak"] >= m["baseline"] + 0.9 * m["held"], m
    assert m["peak"] <= bound, (f"rank {rank}: peak RSS {m['peak'] / MiB:.0f} MiB > baseline "
                                f"{m['baseline'] / MiB:.0f} + {PEAK_FACTOR} x shards {m['held'] / MiB:.0f} "
                                f"+ {ALLOWANCE / MiB:.0f} MiB")
    dist.barrier()


def source_model(cfg: Step37Config) -> Step37Model:
    """The model the HF checkpoint of the tests is written from (every tensor differs from the
    seed-0 initialisation, router biases too)."""
    model = Step37Model(cfg, seed=11)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.5, 0.5, b.numel()))
    return model


class ReadLog:
    """Counts the checkpoint elements a rank asks ``CheckpointIndex.read_into`` for."""

    def __init__(self):
        self.numel = 0
        self._orig = CheckpointIndex.read_into

    def __enter__(self):
        log, orig = self, self._orig

        def read_into(index, out, *a, **k):
            log.numel += out.numel()
            return orig(index, out, *a, **k)

        CheckpointIndex.read_into = read_into
        return self

    def __exit__(self, *exc):
        CheckpointIndex.read_into = self._orig


def _check_against(chunks, ref: Step37Model, what: str) -> None:
    want = dict(ref.named_parameters())
    for c in chunks:
        for name, p, full, rows in global_params(c, want):
            local, first = local_rows(p)
            expect = full.detach()[rows][first:first + local.shape[0]]
            assert local.dtype == torch.float32 and torch.equal(local.cpu(), expect), f"{what}: {name} differs"
        ref_buffers = dict(ref.named_buffers())
        for name, b in c.named_buffers():
            assert b.dtype == torch.float32 and torch.equal(b, ref_buffers[name]), f"{what}: buffer {name} differs"


def check_hf_streaming(rank, world, pp, ep, flags, hf_dir):
    """Seeded and ``--load-hf`` start-ups of the tiny model at this layout: every local shard
    holds exactly the global tensor's rows (seed 0, or the checkpoint's source model), buffers in
    fp32, and the load asked the checkpoint for this rank's rows only."""
    cfg = tiny_config()
    sizes = ParallelSizes(world, pp=pp, ep=ep)
    ps = ParallelState.build(sizes, cfg.num_layers, cfg.num_experts)
    seeded = parallelize(cfg, ps, run_args(pp, 1, ep, *flags))
    _check_against(seeded, Step37Model(cfg, seed=0), "seeded")
    with ReadLog() as log:
        loaded = parallelize(cfg, ps, run_args(pp, 1, ep, "--load-hf", hf_dir, *flags))
    _check_against(loaded, source_model(cfg), "--load-hf")
    held = sum(local_rows(t)[0].numel() for c in loaded for n, t in
               list(c.named_parameters()) + list(c.named_buffers()) if not n.startswith("rotary."))
    assert log.numel == held, (log.numel, held)
    dist.barrier()
