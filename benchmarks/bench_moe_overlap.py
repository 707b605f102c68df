#!/usr/bin/env python3
"""The expert-parallel all-to-all with and without ``--overlap-moe-expert-parallel-comm``, on CPU.

Two gloo ranks (EP2) train a small MoE model (every layer MoE, 16 experts top-4, a shared expert)
through the trainer's own ``parallelize`` and ``train_step``, once with the plain schedule and
once with the overlapped one, on the same packs. Per step: the median step time, and the
exposed all-to-all time: the host seconds spent issuing and waiting for the token all-to-alls
(``CommRecord.blocked_s``; on gloo a wait blocks the host until the rows have arrived, so this
is the time they were not hidden), forward and backward, the slower rank's; and apart from it
the count exchanges (a blocking all-to-all of a few integers per chunk: mostly waiting for the
slower rank to get there). The all-to-all bytes are the same in both.

On a CPU the all-to-all is CPU work too (gloo copies through loopback sockets on its own
threads): it can hide behind compute only where a core is free for it, so run it with
``--threads`` below half the cores per rank.

    python benchmarks/bench_moe_overlap.py [--steps 4] [--hidden 512] [--layers 4] [--seq 4096]
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


def _config(hidden: int, layers: int):
    from models.step37 import Step37Config

    cfg = Step37Config.preset("tiny").to_hf()
    cfg.update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               layer_types=["sliding_attention"] * layers, mlp_layer_types=["sparse"] * layers,
               swiglu_limits=[0] * layers, swiglu_limits_shared=[0] * layers,
               n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=hidden,
               share_expert_dim=hidden, num_nextn_predict_layers=0, mtp_layer_types=[],
               mtp_mlp_layer_types=[], head_dim=32, num_attention_heads=8,
               num_sliding_attention_heads=8, num_key_value_heads=2, sliding_window=128,
               per_layer_config={})
    return Step37Config.from_hf(cfg)


def _rank(rank, world, port, args, out):
    import numpy as np
    import torch
    import torch.distributed as dist

    from core.distributed.collectives import CommRecord
    from core.parallel_state import ParallelSizes, ParallelState
    from core.train_step import StepSettings, train_step
    from data.indexed_dataset import InMemoryDataset
    from data.packing import plan_packs
    from data.thd import build_thd_batch
    from training.parallelize import parallelize
    from train_args import parse

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = _config(args.hidden, args.layers)
    ps = ParallelState.build(ParallelSizes(world, ep=world), cfg.num_layers, cfg.num_experts)
    lengths = np.random.default_rng(0).integers(32, 400, 60)  # the same documents' lengths on both ranks
    rng = np.random.default_rng(rank)                           # (equal attention work), other tokens
    plan = plan_packs(lengths, args.seq, seed=0)
    batch = build_thd_batch([plan.pack(0)], InMemoryDataset([rng.integers(0, cfg.vocab_size, n) for n in lengths]),
                            args.seq, pad_id=0)
    result = {}
    for name, flags in (("plain", []), ("overlap", ["--overlap-moe-expert-parallel-comm"])):
        chunks = parallelize(cfg, ps, parse(["--data-path", "unused", "--expert-model-parallel-size", str(world),
                                             "--seed", "0", *flags]))
        record = CommRecord()
        for c in chunks:
            for m in c.moe_layers():
                m.dispatcher.record = record
        opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1e-4)
        times, blocked = [], []
        for step in range(args.steps + 1):  # the first is a warm-up
            dist.barrier()
            record.blocked_s = {}
            t0 = time.perf_counter()
            train_step(chunks, ps, opt, [batch], StepSettings(hidden_size=cfg.hidden_size))
            times.append(time.perf_counter() - t0)
            blocked.append(record.blocked_s)  # by call: counts, start, wait, grad.start, grad.wait
        sent = sum(m.dispatcher.sent_bytes for c in chunks for m in c.moe_layers()) * 2 / (args.steps + 1)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        waits = [sum(v for k, v in b.items() if k != "counts") for b in blocked[1:]]
        result[name] = {"step": med(times[1:]), "exposed": med(waits),
                        "counts": med([b.get("counts", 0.0) for b in blocked[1:]]), "mib": sent / 2**20}
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096, help="tokens per micro-batch (one pack)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp()
    mp.start_processes(_rank, args=(2, port, args, out), nprocs=2, start_method="spawn")
    ranks = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(2)]
    print(f"EP2 on gloo, {os.cpu_count()} CPU cores, {args.threads} thread(s) per rank: hidden {args.hidden}, "
          f"{args.layers} MoE layers (16 experts top-4, shared expert), one {args.seq}-token pack per rank")
    print(f"{'schedule':<10}{'step s':>9}{'exposed all-to-all s':>22}{'share of step':>15}{'count exchange s':>18}"
          f"{'all-to-all MiB/rank':>21}")
    for name in ("plain", "overlap"):
        step, exposed, counts, mib = (max(r[name][k] for r in ranks) for k in ("step", "exposed", "counts", "mib"))
        print(f"{name:<10}{step:>9.3f}{exposed:>22.3f}{100 * exposed / step:>14.1f}%{counts:>18.3f}{mib:>21.1f}")
    print(f"reproduce: python benchmarks/bench_moe_overlap.py --steps {args.steps} --hidden {args.hidden} "
          f"--layers {args.layers} --seq {args.seq} --threads {args.threads}")


if __name__ == "__main__":
    main()
