#!/usr/bin/env python3
"""Will this layout fit? Per-rank bytes of parameters, gradients, optimizer state, activations,
p2p and all-to-all buffers, on device and on host, without allocating anything (each rank's share
is built on the meta device). Takes every flag of pretrain_step37.py, so a training command can
be pasted after ``--world-size N``; --data-path and the tokenizer flags are accepted and ignored.

    python tools/plan_memory.py --world-size 8 --model-preset step37-flash \\
        --pipeline-model-parallel-size 4 --expert-model-parallel-size 2 --seq-length 8192 \\
        --global-batch-size 64 --optimizer muon --muon-momentum 0 --params-dtype bf16 \\
        --recompute-granularity full --data-parallel-sharding fsdp --cpu-offload all [--json]
"""
from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train_args import build_parser, sections, validate  # noqa: E402
from training.plan import report  # noqa: E402


def build_planner_parser():
    parser = build_parser(require_data=False, prog="plan_memory.py",
                          description=__doc__.split("\n\n")[0].replace("\n", " "))
    g = parser.add_argument_group("planner", "what to plan for")
    g.add_argument("--world-size", type=int, required=True,
                   help="number of ranks of the run (GPUs; torchrun's nodes x nproc-per-node)")
    g.add_argument("--device-gb", type=float, default=141.0, help="device memory in GB (default: 141, H200)")
    g.add_argument("--json", action="store_true", help="print JSON, one entry per rank")
    return parser


def main(argv=None) -> int:
    parser = build_planner_parser()
    ns = parser.parse_args(argv)
    args = sections(ns, parser)
    try:
        layout = validate(args, ns.world_size, check_files=False)
    except ValueError as e:
        print(f"plan_memory.py: error: {e}", file=sys.stderr)
        return 2
    return report(args, layout, as_json=ns.json, device_gb=ns.device_gb)


if __name__ == "__main__":
    sys.exit(main())
