#!/usr/bin/env python3
"""Will this layout fit? Per-rank bytes of parameters, gradients, optimizer state, activations,
p2p and all-to-all buffers, on device and on host, for a model and a parallel layout, without
allocating anything (the model is built on the meta device, every rank simulated here).

    python tools/plan_memory.py --model-preset step37-flash --pp 4 --ep 2 --dp 2 \\
        --seq-length 8192 --num-microbatches 32 --optimizer muon --muon-momentum 0 \\
        --recompute-granularity full --data-parallel-sharding fsdp --cpu-offload all [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.step37 import Step37Config  # noqa: E402
from models.step37.config import PRESETS  # noqa: E402
from models.step37.memory_plan import GB, PlanInputs, as_dict, format_table, plan  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model-preset", choices=sorted(PRESETS), default="step37-flash")
    src.add_argument("--hf-config", help="a Hugging Face config.json or directory")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --dp)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size (world = pp x dp)")
    ap.add_argument("--data-parallel-sharding", choices=("none", "fsdp"), default="none")
    ap.add_argument("--cpu-offload", choices=("none", "all", "experts"), default="none")
    ap.add_argument("--recompute-granularity", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--recompute-num-layers", type=int, default=0, help="first N layers per chunk (0: all)")
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--num-microbatches", type=int, default=8, help="per pipeline per iteration")
    ap.add_argument("--optimizer", choices=("adamw", "muon", "dion"), default="muon")
    ap.add_argument("--muon-momentum", type=float, default=0.0)
    ap.add_argument("--dion-rank-fraction", type=float, default=0.25)
    ap.add_argument("--params-dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device-gb", type=float, default=141.0, help="device memory in GB (H200: 141)")
    ap.add_argument("--pipeline-layout", help="layers per virtual stage, e.g. 11,12,11,11")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = Step37Config.from_hf(args.hf_config) if args.hf_config else Step37Config.preset(args.model_preset)
        inp = PlanInputs(pp=args.pp, vpp=args.vpp, ep=args.ep, dp=args.dp,
                         sharding=args.data_parallel_sharding, cpu_offload=args.cpu_offload,
                         recompute=args.recompute_granularity, recompute_num_layers=args.recompute_num_layers,
                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                         num_microbatches=args.num_microbatches, optimizer=args.optimizer,
                         muon_momentum=args.muon_momentum, dion_rank_fraction=args.dion_rank_fraction,
                         param_bytes=2 if args.params_dtype == "bf16" else 4, device_gb=args.device_gb,
                         pipeline_layout=args.pipeline_layout)
        ranks = plan(cfg, inp)
    except ValueError as e:
        print(f"plan_memory: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"inputs": vars(inp), "ranks": as_dict(ranks)}, indent=2))
        return 0
    print(format_table(ranks, inp))
    worst = max(ranks, key=lambda r: r.device_total)
    print(f"plan_memory: world {inp.pp * inp.dp}; busiest rank pp{worst.pp_rank} ep{worst.ep_rank} needs "
          f"{worst.device_total / GB:.1f} GB on device, {worst.host_total / GB:.1f} GB on host: "
          f"{'fits' if all(r.fits for r in ranks) else 'does NOT fit'} {inp.device_gb:g} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
