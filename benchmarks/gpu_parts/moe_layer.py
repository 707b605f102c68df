"""Part (c): one full-width MoE decoder layer (Step-3.7-Flash: its first, a sliding-window layer
of 96 heads with all 288 experts and the shared expert) forward + backward on one 8192-token pack
in bf16 (router fp32), as ``benchmarks/bench_gpu.py`` builds it (``model_slice.py``).

Prints every device sync of one step as ``torch.cuda.set_sync_debug_mode("warn")`` reports it,
and every host read our counter (``tests/host_reads.py``, the CPU tests' tool) sees, with where
each comes from: one MoE layer on one GPU (the local dispatcher) should make none. Then the median
of 5 timed steps, TFLOP/s and MFU (``core/costs/flops.py``'s count for this layer: the one behind the
training logs) and the peak memory of those steps, allocated and reserved, beside the planner's
(``training/planner/memory.py``: the weights and gradients as held, the layer's activations)."""
from __future__ import annotations

import sys

from benchmarks.gpu_parts import common

import torch  # noqa: E402


def run(preset: str, device, seq: int, seed: int = 0, iters: int = 5) -> dict:
    from benchmarks.model_slice import build_ours, init_weights, moe_layers, packed_batch, slice_config, slice_flops
    from core.costs.flops import device_peak_tflops
    from models import registry
    from tests.host_reads import HostReads
    from training.planner.timing import TimeAssumptions

    full = registry.resolve(preset)[1]
    cfg, idx = slice_config(full, layers=moe_layers(full)[:1])
    batch, lengths = packed_batch(seq, seed)
    batch = batch.to(device)
    ours = build_ours(cfg, device, common.compute_dtype(device))
    init_weights(ours, seed, std=cfg.init_std)
    g = torch.Generator(device).manual_seed(seed + 1)
    x = torch.randn(seq, cfg.hidden_size, device=device, generator=g, dtype=common.compute_dtype(device)).requires_grad_()
    dy = torch.randn(seq, cfg.hidden_size, device=device, generator=g, dtype=common.compute_dtype(device))

    def step():
        ours.zero_grad(set_to_none=True)
        x.grad = None
        ours(x, batch).backward(dy)

    step()  # warm-up: kernels chosen, allocator filled
    with common.syncs_listed(device) as syncs, HostReads() as reads:
        step()
    common.reset_peak(device)
    ms = common.median_ms(step, device, warmup=0, iters=iters)
    flops = slice_flops(cfg, lengths)
    peak_tf = device_peak_tflops() if device.type == "cuda" else None
    tflops = flops / ms / 1e9
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    planned = common.planned_layers_gib(cfg, seq, nbytes(ours.parameters()),
                                        nbytes(p.grad for p in ours.parameters() if p.grad is not None))
    peak = common.peak_memory(device)
    return {"layer": idx[0], "parameters": sum(p.numel() for p in ours.parameters()), "tokens": sum(lengths),
            "documents": len(lengths), "ms": ms, "tflops": tflops, "mfu": tflops / peak_tf if peak_tf else None,
            "peak_gib": peak["peak_allocated_gib"], **peak, "planned_gib": planned,
            "compare": [{"what": "one MoE layer fwd+bwd MFU", "measured": tflops / peak_tf if peak_tf else None,
                         "planned": TimeAssumptions().assumed_mfu},  # the planner's MFU for every matmul
                        *common.memory_compare("one MoE layer fwd+bwd", peak, planned)], "syncs": syncs,
            "host_reads": [f"{w}: {k}" for k, w in reads.reads],
            "passed": not syncs and not reads.reads}


def main(argv=None) -> int:
    args = common.parse(__doc__.split("\n\n")[0], argv)
    device = common.device_for(args)
    if device is None:
        return common.NO_CUDA
    r = run(common.preset_of(args), device, 128 if args.tiny else 8192, args.seed, iters=2 if args.tiny else 5)
    print(f"layer {r['layer']}: {r['parameters'] / 1e9:.2f} B parameters, {r['tokens']} tokens in {r['documents']} "
          f"documents")
    print(f"device syncs in one forward + backward: {len(r['syncs'])}")
    for s in r["syncs"]:
        print(f"  sync: {s}")
    print(f"host reads (tests/host_reads.py): {len(r['host_reads'])}")
    for s in r["host_reads"]:
        print(f"  read: {s}")
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
    mem = common.memory_text(r, r["planned_gib"])
    print(f"forward + backward {r['ms']:.1f} ms (median), {r['tflops']:.3g} TFLOP/s, MFU {mfu}; {mem} (weights, "
          f"grads, activations: training/planner/memory.py)")
    r["headline"] = (f"MoE layer: {len(r['syncs'])} syncs, {len(r['host_reads'])} host reads; {r['ms']:.1f} ms, "
                     f"{r['tflops']:.3g} TFLOP/s, MFU {mfu}, {mem}")
    r["part"] = "c"
    return common.finish(args, r)


if __name__ == "__main__":
    sys.exit(main())
