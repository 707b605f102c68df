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

The same ``measure`` runs on one GPU as ``tools/gpu_check.sh``'s part j
(``benchmarks/gpu_parts/moe_overlap.py``: two ranks sharing the GPU over gloo, the exposed
all-to-all there the compute stream's waits, ``StallRecord``).

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

from core.distributed.collectives import CommRecord  # noqa: E402


def moe_config(hidden: int, layers: int, expert_size: int | None = None):
    """The benchmark's model (also ``benchmarks/gpu_parts/moe_overlap.py``'s): every layer MoE,
    16 experts top-4 of ``expert_size`` (default ``hidden``), a shared expert of ``hidden``."""
    from models.step37 import Step37Config

    cfg = Step37Config.preset("tiny").to_hf()
    cfg.update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               layer_types=["sliding_attention"] * layers, mlp_layer_types=["sparse"] * layers,
               swiglu_limits=[0] * layers, swiglu_limits_shared=[0] * layers,
               n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=expert_size or hidden,
               share_expert_dim=hidden, num_nextn_predict_layers=0, mtp_layer_types=[],
               mtp_mlp_layer_types=[], head_dim=32, num_attention_heads=8,
               num_sliding_attention_heads=8, num_key_value_heads=2, sliding_window=128,
               per_layer_config={})
    return Step37Config.from_hf(cfg)


SCHEDULES = (("plain", ()), ("overlap", ("--overlap-moe-expert-parallel-comm",)))


def run_flags(world: int, extra=()) -> list[str]:
    """The trainer's flags of both schedules (``SCHEDULES`` adds the overlap's)."""
    return ["--data-path", "unused", "--expert-model-parallel-size", str(world), "--seed", "0", *extra]


class StallRecord(CommRecord):
    """A ``CommRecord`` that, on CUDA, also records an event on the current (compute) stream
    before and after each all-to-all call: the time between the two on the GPU's clock is how
    long the compute stream stood waiting for it (a wait makes the compute stream wait for the
    copy back and, on gloo, blocks the host until the exchange is done, so the stream drains what
    the host had queued and then idles; a start costs the stream nothing). On the CPU the host's
    seconds in each call (``blocked_s``) are the same measure. Read ``exposed()`` after a sync."""

    def __init__(self, cuda: bool):
        super().__init__()
        self.cuda, self.pairs = cuda, []

    def timed(self, tag, what, fn):
        if not self.cuda:
            return super().timed(tag, what, fn)
        import torch

        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = super().timed(tag, what, fn)
        b.record()
        self.pairs.append((what, a, b))
        return out

    def reset(self) -> None:
        self.events, self.blocked_s, self.pairs = [], {}, []

    def exposed(self) -> dict:
        """Seconds by call (counts, start, wait, grad.start, grad.wait): the compute stream's
        stalls on CUDA (events read: sync first), the host's on the CPU."""
        if not self.cuda:
            return dict(self.blocked_s)
        out: dict = {}
        for what, a, b in self.pairs:
            out[what] = out.get(what, 0.0) + a.elapsed_time(b) / 1e3
        return out


def measure(rank: int, world: int, args, flags=(), watch=None) -> dict:
    """Both schedules on this rank (its process group already made, ``world`` ranks, on
    ``core.parallel_state.local_device()``): per schedule the median step seconds, the exposed
    all-to-all (rows; ``StallRecord``) and count exchanges, and the all-to-all MiB a step.
    ``args``: ``hidden``, ``layers``, ``seq``, ``steps`` (timed, after one warm-up) and
    ``expert_size`` (optional); ``flags``: more trainer flags (``--bf16``); ``watch``: a context
    manager factory around the overlapped schedule's warm-up step (the GPU part lists its syncs)."""
    import contextlib

    import numpy as np
    import torch
    import torch.distributed as dist

    from core.parallel_state import ParallelSizes, ParallelState, local_device
    from core.train_step import StepSettings, train_step
    from data.indexed_dataset import InMemoryDataset
    from data.packing import plan_packs
    from data.thd import build_thd_batch
    from training.parallelize import parallelize
    from train_args import parse

    cfg = moe_config(args.hidden, args.layers, getattr(args, "expert_size", None))
    cuda = local_device().type == "cuda"
    ps = ParallelState.build(ParallelSizes(world, ep=world), cfg.num_layers, cfg.num_experts)
    lengths = np.random.default_rng(0).integers(32, 400, 60)  # the same documents' lengths on both ranks
    rng = np.random.default_rng(rank)                           # (equal attention work), other tokens
    plan = plan_packs(lengths, args.seq, seed=0)
    batch = build_thd_batch([plan.pack(0)], InMemoryDataset([rng.integers(0, cfg.vocab_size, n) for n in lengths]),
                            args.seq, pad_id=0)
    result = {}
    for name, more in SCHEDULES:
        chunks = parallelize(cfg, ps, parse(run_flags(world, (*flags, *more))))
        record = StallRecord(cuda)
        for layer in [m for c in chunks for m in c.moe_layers()]:
            layer.dispatcher.record = record
        opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1e-4)
        times, exposed = [], []
        for step in range(args.steps + 1):  # the first is a warm-up
            dist.barrier()
            record.reset()
            around = watch() if watch and more and step == 0 else contextlib.nullcontext()
            t0 = time.perf_counter()
            with around:
                train_step(chunks, ps, opt, [batch], StepSettings(hidden_size=cfg.hidden_size))
            if cuda:
                torch.cuda.synchronize()  # the step's end, and its events readable
            times.append(time.perf_counter() - t0)
            exposed.append(record.exposed())  # by call: counts, start, wait, grad.start, grad.wait
        sent = sum(m.dispatcher.sent_bytes for c in chunks for m in c.moe_layers()) * 2 / (args.steps + 1)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        waits = [sum(v for k, v in b.items() if k != "counts") for b in exposed[1:]]
        result[name] = {"step": med(times[1:]), "exposed": med(waits),
                        "counts": med([b.get("counts", 0.0) for b in exposed[1:]]), "mib": sent / 2**20}
        del chunks, opt, layer  # the plain schedule's model freed before the overlapped one's is built
    return result


def slower(ranks: list) -> dict:
    """Per schedule and measure, the slower rank's (what a step of the group takes)."""
    return {name: {k: max(r[name][k] for r in ranks) for k in ranks[0][name]} for name, _ in SCHEDULES}


def _rank(rank, world, port, args, out):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = measure(rank, world, args)
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
    worst = slower(ranks)
    for name, _ in SCHEDULES:
        step, exposed, counts, mib = (worst[name][k] for k in ("step", "exposed", "counts", "mib"))
        print(f"{name:<10}{step:>9.3f}{exposed:>22.3f}{100 * exposed / step:>14.1f}%{counts:>18.3f}{mib:>21.1f}")
    print(f"reproduce: python benchmarks/bench_moe_overlap.py --steps {args.steps} --hidden {args.hidden} "
          f"--layers {args.layers} --seq {args.seq} --threads {args.threads}")


if __name__ == "__main__":
    main()
