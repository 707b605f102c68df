#!/usr/bin/env python3
"""Pipeline bubbles of real layouts against the textbook, and a measured parallel step on CPU.

1. Simulated bubble (the executor's own action lists; backward = 2 x forward, equal stages):
   StepFun's Step-3.7 layout (PP8, 3 virtual stages, 32 micro-batches) and NeMo Automodel's
   (PP4, EP2; 8 micro-batches), against (p-1)/(m+p-1) and its interleaved form (p-1)/(v*m+p-1).
2. Measured time of the trainer's ``train_step`` (forward, backward, gradient sync, clipping,
   an SGD update) on 4 gloo ranks (PP2 x EP2) against 1 rank on the same global batch of a
   small MoE model, with the bytes each rank moves per step by pipeline p2p and by the expert
   all-to-all (backward moves as much as forward).

    python benchmarks/bench_parallel.py [--steps 3] [--hidden 256] [--layers 8]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bubbles() -> None:
    from core.pipeline.schedules import build_schedule
    from core.pipeline.simulate import simulate, textbook_bubble

    print("simulated pipeline bubble (equal stages, backward = 2 x forward)")
    print(f"{'layout':<36}{'simulated':>10}{'textbook':>10}{'peak in flight':>16}")
    for name, pp, vpp, m in (("StepFun Step-3.7: PP8 x 3 virtual, m=32", 8, 3, 32),
                             ("StepFun layout without interleaving", 8, 1, 32),
                             ("Automodel: PP4 (x EP2), m=8", 4, 1, 8),
                             ("Automodel layout, m=32", 4, 1, 32)):
        r = simulate(build_schedule(pp, vpp, m))
        print(f"{name:<36}{100 * r.bubble:>9.2f}%{100 * textbook_bubble(pp, m, vpp):>9.2f}%"
              f"{max(r.peak_in_flight):>16}")


def _config(hidden, layers):
    from models.step37 import Step37Config

    cfg = Step37Config.preset("tiny").to_hf()
    types = ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)]
    cfg.update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               layer_types=types, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1),
               swiglu_limits=[0] * layers, swiglu_limits_shared=[0] * layers,
               n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=hidden // 2,
               share_expert_dim=hidden // 2, num_nextn_predict_layers=0, mtp_layer_types=[],
               mtp_mlp_layer_types=[], head_dim=32, num_attention_heads=8,
               num_sliding_attention_heads=8, num_key_value_heads=2, sliding_window=128,
               per_layer_config={})
    return Step37Config.from_hf(cfg)


def _rank(rank, world, port, args, out):
    import numpy as np
    import torch
    import torch.distributed as dist

    from core.parallel_state import ParallelSizes, ParallelState
    from core.train_step import StepSettings, train_step
    from data.indexed_dataset import InMemoryDataset
    from data.packing import plan_packs
    from data.thd import build_thd_batch
    from training.parallelize import parallelize
    from train_args import parse

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = _config(args.hidden, args.layers)
    pp, ep = (2, 2) if world == 4 else (1, 1)
    ps = ParallelState.build(ParallelSizes(world, pp=pp, ep=ep), cfg.num_layers, cfg.num_experts)
    chunks = parallelize(cfg, ps, parse(["--data-path", "unused", "--pipeline-model-parallel-size", str(pp),
                                         "--expert-model-parallel-size", str(ep)]))
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1e-4)
    dp, M_total, S = ps.sizes.dp, 8, args.seq
    M = M_total // dp

    def batch(m):
        g = ps.dp_rank * M + m  # same global batch whatever the layout
        rng = np.random.default_rng(g)
        lengths = rng.integers(16, 200, 40)
        plan = plan_packs(lengths, S, seed=0)
        return build_thd_batch([plan.pack(0)], InMemoryDataset([rng.integers(0, cfg.vocab_size, n) for n in lengths]),
                               S, pad_id=0)

    batches = [batch(m) for m in range(M)]
    settings = StepSettings(hidden_size=cfg.hidden_size, clip_grad=1.0)
    times, p2p = [], 0
    for step in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        p2p += train_step(chunks, ps, optimizer, batches, settings).p2p_bytes
        dist.barrier()
        times.append(time.perf_counter() - t0)
    a2a = sum(getattr(m.dispatcher, "sent_bytes", 0) for c in chunks for m in c.moe_layers())
    steps = args.steps + 1
    with open(os.path.join(out, f"{world}_{rank}.json"), "w") as f:
        json.dump({"step": sorted(times[1:])[len(times[1:]) // 2], "p2p": p2p / steps,
                   "a2a": 2 * a2a / steps}, f)
    dist.destroy_process_group()


def measure(world: int, args) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp()
    mp.start_processes(_rank, args=(world, port, args, out), nprocs=world, start_method="spawn")
    return [json.load(open(os.path.join(out, f"{world}_{r}.json"))) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per micro-batch")
    args = ap.parse_args()
    bubbles()
    one, four = measure(1, args), measure(4, args)
    print(f"\nmeasured step on {os.cpu_count()} CPU cores: MoE model hidden {args.hidden}, "
          f"{args.layers} layers, 16 experts top-4, 8 micro-batches of {args.seq} tokens")
    print(f"{'layout':<22}{'step s':>9}{'p2p MiB/rank':>14}{'all-to-all MiB/rank':>21}")
    print(f"{'1 rank':<22}{one[0]['step']:>9.2f}{0:>14.1f}{0:>21.1f}")
    step4 = max(r["step"] for r in four)
    p2p = max(r["p2p"] for r in four) / 2**20
    a2a = max(r["a2a"] for r in four) / 2**20
    print(f"{'4 ranks (PP2 x EP2)':<22}{step4:>9.2f}{p2p:>14.1f}{a2a:>21.1f}")
    print(f"(4 processes share {os.cpu_count()} cores here, so the 4-rank time measures overhead, "
          "not speed-up)")
    print(f"reproduce: python benchmarks/bench_parallel.py --steps {args.steps} --hidden {args.hidden} "
          f"--layers {args.layers} --seq {args.seq}")


if __name__ == "__main__":
    main()
