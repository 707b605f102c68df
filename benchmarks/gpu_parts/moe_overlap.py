"""Part (j): the expert-parallel all-to-all with and without ``--overlap-moe-expert-parallel-comm``
on the one lent GPU, beside the planner's prediction for the same layers and sizes.

Two ranks (EP2) share the one GPU over gloo (NCCL refuses two ranks on one device; gloo's
all-to-all of CUDA tensors stages them through pinned host memory on a stream of its own) and run
``benchmarks/bench_moe_overlap.py``'s model and measurement (its ``measure``: the trainer's own
``parallelize`` and ``train_step``, the plain schedule, then the overlapped one, on the same
packs), in ``--bf16``, at a size where a step takes a second or two: every layer MoE, 16 experts
top-4 of ``--expert-size`` 8192 (large beside the hidden size 2048 so that the experts' compute
is of the order of gloo's all-to-all), one 8192-token pack per rank. Per schedule, the slower
rank's: the median step, and the exposed all-to-all: how long the compute stream stood waiting
at the all-to-alls (CUDA events on the compute stream around each call,
``bench_moe_overlap.StallRecord``), the count exchanges apart. It also lists the device syncs of
one overlapped step (``torch.cuda.set_sync_debug_mode("warn")``; the split sizes' read, one per
chunk, is the layer's own).

What it measures is the mechanism, not the recipe's numbers: whether the overlap hides the
all-to-all on real CUDA streams and whether anything syncs the host. Gloo through host memory is
far slower than NVLink, and the two ranks share the GPU's SMs (their kernels take turns), so the
compute beside an all-to-all is the two ranks' together. So the planner's prediction beside it
(``training/planner/timing.py`` with ``training/planner/overlap.py``'s model of what is hidden,
for the same model, EP2, one micro-batch of one pack) takes this run's own rates as its
assumptions: the all-to-all bandwidth the part measures first (a dispatch-sized all-to-all over
the same gloo group) and the compute rate of the plain step (its step less its exposed all-to-all
and count exchanges), so that it predicts the hiding, not the bandwidth or the MFU.
``--model-preset`` is accepted and not used (the part has its own model).
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

from benchmarks.bench_moe_overlap import SCHEDULES, measure, moe_config, run_flags, slower
from benchmarks.gpu_parts import common

import torch  # noqa: E402

WORLD = 2
FULL = {"hidden": 2048, "layers": 4, "expert_size": 8192, "seq": 8192, "steps": 3}
TINY = {"hidden": 64, "layers": 2, "expert_size": 64, "seq": 512, "steps": 1}


def _extra(ap) -> None:
    for k, v in FULL.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, help=f"default {v}; --tiny: {TINY[k]}")


def sizes(args) -> None:
    """Fill the sizes not given from ``FULL`` (``TINY`` with ``--tiny``)."""
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def a2a_bandwidth(args, cfg, dtype, device, world: int, reps: int = 3) -> float:
    """Bytes per second one rank sends to the others in a dispatch-sized all-to-all (``seq x
    top_k`` rows of ``hidden``, equal splits) over the world group: the planner's ``x`` per
    dispatch is its bytes over this."""
    import torch.distributed as dist

    x = torch.randn(args.seq * cfg.num_experts_per_tok, cfg.hidden_size, device=device).to(dtype)
    out = torch.empty_like(x)
    crossing = x.numel() * x.element_size() * (world - 1) / world
    times = []
    for i in range(reps + 1):  # the first: gloo's pinned buffers and connections
        dist.barrier()
        common.sync(device)
        t0 = time.perf_counter()
        dist.all_to_all_single(out, x)
        common.sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return crossing / statistics.median(times)


def rank_result(rank: int, world: int, args, cuda: bool) -> dict:
    """One rank's measurements, its process group made: the all-to-all bandwidth, then both
    schedules (``bench_moe_overlap.measure``; ``--bf16`` on CUDA), with the syncs of the
    overlapped warm-up step on CUDA."""
    from core.parallel_state import local_device

    device = local_device()
    cfg = moe_config(args.hidden, args.layers, args.expert_size)
    bw = a2a_bandwidth(args, cfg, torch.bfloat16 if cuda else torch.float32, device, world)
    syncs: list = []

    @contextmanager
    def watch():
        with common.syncs_listed(device) as found:
            yield
        syncs.extend(found)

    result = measure(rank, world, args, flags=("--bf16",) if cuda else (), watch=watch if cuda else None)
    return {**result, "bytes_per_s": bw, "syncs": syncs}


def predict(args, world: int, bf16: bool, bytes_per_s: float, compute_s: float) -> dict:
    """The planner's step and exposed all-to-all per schedule for the part's model at EP ``world``
    (one micro-batch of one ``seq``-token pack per rank), with ``bytes_per_s`` as the EP group's
    bandwidth and the compute rate that makes its compute ``compute_s``."""
    from train_args import parse, validate
    from training.planner.run import plan_inputs
    from training.planner.timing import TimeAssumptions, plan_time

    cfg = moe_config(args.hidden, args.layers, args.expert_size)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        hf = cfg.to_hf()  # the packs' documents are short: a pack longer than the tiny preset's positions is fine
        hf["max_position_embeddings"] = max(hf["max_position_embeddings"], args.seq)
        with open(path, "w") as f:
            json.dump(hf, f)
        flags = run_flags(world, ["--hf-config", path, "--seq-length", str(args.seq), "--micro-batch-size", "1",
                                  "--global-batch-size", str(world), *(["--bf16"] if bf16 else [])])
        layouts = {}
        for name, more in SCHEDULES:
            a = parse([*flags, *more])
            layout = validate(a, world=world, check_files=False)
            layouts[name] = (layout.config, plan_inputs(a, layout))

    def plan(peak_tflops: float, name: str):
        assume = TimeAssumptions(assumed_mfu=1.0, nvlink_gb_s=bytes_per_s / 1e9)
        return plan_time(*layouts[name], assume, peak_tflops, world)

    flops = plan(1.0, "plain").ranks[0].seconds["compute"] * 1e12  # its compute at 1 TFLOP/s
    peak = flops / 1e12 / compute_s
    out = {"assumed_tflops": peak, "assumed_gb_s": bytes_per_s / 1e9}
    for name, _ in SCHEDULES:
        st = plan(peak, name)
        sec = st.ranks[0].seconds
        out[name] = {"step": st.step_s, "exposed": sec["all-to-all"], "compute": sec["compute"],
                     "breakdown": {k: v for k, v in sec.items() if v}}
    return out


def report(ranks: list, args, cuda: bool) -> dict:
    """The part's JSON from each rank's ``rank_result``: the slower rank's numbers per schedule
    beside the planner's, the ``compare`` rows and the headline."""
    worst = slower(ranks)
    plain = worst["plain"]
    bw = min(r["bytes_per_s"] for r in ranks)
    compute = max(plain["step"] - plain["exposed"] - plain["counts"], 1e-3 * plain["step"])
    planned = predict(args, len(ranks), cuda, bw, compute)
    compare = []
    for name, _ in SCHEDULES:
        compare.append({"what": f"EP2 over gloo, {name}: step", "measured": worst[name]["step"],
                        "planned": planned[name]["step"], "unit": "s"})
        compare.append({"what": f"EP2 over gloo, {name}: exposed all-to-all", "measured": worst[name]["exposed"],
                        "planned": planned[name]["exposed"], "unit": "s"})
    compare.append({"what": "EP2 over gloo: all-to-all hidden by the overlap",
                    "measured": plain["exposed"] - worst["overlap"]["exposed"],
                    "planned": planned["plain"]["exposed"] - planned["overlap"]["exposed"], "unit": "s"})
    numbers = [worst[n][k] for n, _ in SCHEDULES for k in worst[n]] + [bw]
    syncs = ranks[0]["syncs"]
    w, p = worst, planned
    where = "one GPU (the mechanism, not the recipe's numbers)" if cuda else "the CPU"
    headline = (f"EP2 over gloo on {where}: step {w['plain']['step']:.3g} -> {w['overlap']['step']:.3g} s "
                f"(planned {p['plain']['step']:.3g} -> {p['overlap']['step']:.3g}), "
                f"exposed all-to-all {w['plain']['exposed']:.3g} -> {w['overlap']['exposed']:.3g} s (planned "
                f"{p['plain']['exposed']:.3g} -> {p['overlap']['exposed']:.3g}) at {bw / 1e9:.3g} GB/s; "
                f"{len(syncs)} syncs in an overlapped step")
    return {"part": "j", "sizes": {k: getattr(args, k) for k in FULL}, "measured": worst, "planned": planned,
            "bytes_per_s": bw, "syncs": syncs, "ranks": ranks, "compare": compare, "headline": headline,
            "passed": all(v == v and abs(v) != float("inf") for v in numbers)}


def table(r: dict) -> str:
    lines = [f"{'schedule':<10}{'step s':>9}{'planned':>9}{'exposed all-to-all s':>22}{'planned':>9}"
             f"{'count exchange s':>18}{'all-to-all MiB/rank':>21}"]
    for name, _ in SCHEDULES:
        m, p = r["measured"][name], r["planned"][name]
        lines.append(f"{name:<10}{m['step']:>9.3f}{p['step']:>9.3f}{m['exposed']:>22.3f}{p['exposed']:>9.3f}"
                     f"{m['counts']:>18.3f}{m['mib']:>21.1f}")
    return "\n".join(lines)


def _rank(rank, world, port, args, out, cuda):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(0)  # both ranks on the one GPU
    else:
        torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = rank_result(rank, world, args, cuda)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    args = common.parse(__doc__.split("\n\n")[0], argv, _extra)
    device = common.device_for(args)
    if device is None:
        return common.NO_CUDA
    sizes(args)
    cuda = device.type == "cuda"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(WORLD, port, args, out, cuda), nprocs=WORLD, start_method="spawn")
        ranks = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(WORLD)]
    r = report(ranks, args, cuda)
    print(f"EP{WORLD} over gloo on {'one GPU, both ranks' if cuda else 'the CPU'}: hidden {args.hidden}, "
          f"{args.layers} MoE layers (16 experts top-4 of {args.expert_size}, shared expert), one {args.seq}-token "
          f"pack per rank, {'bf16' if cuda else 'fp32'}; all-to-all {r['bytes_per_s'] / 1e9:.3g} GB/s per rank "
          f"(measured here: the planner's assumption), compute {r['planned']['assumed_tflops']:.3g} TFLOP/s (the "
          f"plain step's: the planner's assumption)")
    print(table(r))
    if cuda:
        print("the mechanism, not the recipe's numbers: gloo stages through host memory (far slower than NVLink) "
              "and the two ranks share the one GPU's SMs")
    for s in r["syncs"]:
        print(f"  sync: {s}")
    return common.finish(args, r)


if __name__ == "__main__":
    sys.exit(main())
