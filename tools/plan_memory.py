#!/usr/bin/env python3
"""Will this layout fit, and how fast will it run? Per-rank bytes of parameters, gradients,
optimizer state, activations, p2p and all-to-all buffers, on device and on host, and the
predicted step time and tokens/s per GPU, without allocating anything (each rank's share is
built on the meta device). Takes every flag of pretrain_step37.py, so a training command can
be pasted after ``--world-size N``; --data-path and the tokenizer flags are accepted and ignored.

    python tools/plan_memory.py --world-size 8 --model-preset step37-flash \\
        --pipeline-model-parallel-size 4 --expert-model-parallel-size 2 --seq-length 8192 \\
        --global-batch-size 64 --optimizer muon --muon-momentum 0 --bf16 \\
        --recompute-granularity full --data-parallel-sharding fsdp --cpu-offload all [--json]

With ``--search`` it lists every layout of the world size (pipeline and virtual stages, EP,
sharding, offload, gather-once, recompute, micro-batch size; with
``--overlap-moe-expert-parallel-comm`` the all-to-all overlap on and off) that fits, fastest
first; the model, sequence length, global batch, precision and optimizer stay as given:

    python tools/plan_memory.py --search --world-size 8 --model-preset step37-flash \\
        --seq-length 8192 --global-batch-size 64 --bf16 --optimizer muon --muon-momentum 0

A vision-language model's images: ``--image-token-share 0.25 --image-crops-per-image 4`` (a
quarter of each pack's tokens image features, every image a global view and 4 crops on
average); the vision tower's cost goes on the first pipeline stage (docs/vlm.md, "Planner").

``--trace [--trace-ranks R,...]`` also runs the real build, parallelize and training step of one
rank (by default the busiest) on fake tensors in a fake process group and prints its traced
peak beside the plan (docs/memory.md, "The Traced Peak").
"""
from __future__ import annotations

import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.cli import add_to_parser, from_namespace  # noqa: E402
from training.planner.timing import TimeAssumptions  # noqa: E402
from train_args import SECTIONS, build_parser, model_config, sections, validate_plan  # noqa: E402
from training.planner.overlap import FLAG  # noqa: E402
from training.planner.run import DEFAULT_DEVICE_GB, check_plannable, report, search_report  # noqa: E402
from training.planner.vision import add_image_flags, image_mix  # noqa: E402


def build_planner_parser():
    parser = build_parser(require_data=False, prog="plan_memory.py",
                          description=__doc__.split("\n\n")[0].replace("\n", " "))
    g = parser.add_argument_group("planner", "what to plan for")
    g.add_argument("--world-size", type=int, required=True,
                   help="number of ranks of the run (GPUs; torchrun's nodes x nproc-per-node)")
    g.add_argument("--device-gb", type=float, default=DEFAULT_DEVICE_GB,
                   help=f"device memory in GB (default: {DEFAULT_DEVICE_GB:g}, H200)")
    g.add_argument("--json", action="store_true", help="print JSON: one entry per rank, or with "
                                                       "--search every layout")
    g.add_argument("--search", action="store_true", help="rank every layout of --world-size that fits, "
                                                         "fastest first (the layout flags given are ignored; "
                                                         f"with {FLAG}, each EP layout with and without it)")
    g.add_argument("--top", type=int, default=20, help="rows of the --search table (default: 20)")
    g.add_argument("--reserve-gb", type=float, default=None,
                   help="--search: device memory a layout must leave free to count as fitting, for what "
                        "the plan does not count (CUDA context, NCCL buffers, allocator fragmentation, "
                        "transient workspaces; default: 7%% of --device-gb, 10 GB on an H200)")
    g.add_argument("--host-gb", type=float, default=2000.0,
                   help="--search: host memory per node in GB that a layout may use (default: 2000, "
                        "a DGX H200's 2 TB; 0: no limit)")
    add_image_flags(parser)
    if "time" not in SECTIONS:  # pretrain_step37.py's flags do not carry the time model (yet)
        add_to_parser(parser, TimeAssumptions, "time model")
    return parser


def planned(argv=None):
    """The parsed flags, the sections, the time model and the validated layout (None with
    ``--search``, which replaces the layout flags): ``ValueError`` naming the flag for what cannot
    be planned, through ``train_args.validate_plan`` as ``pretrain_step37.py --dry-run`` does; a
    usage error (``SystemExit``) for what a section refuses."""
    parser = build_planner_parser()
    ns = parser.parse_args(argv)
    args = sections(ns, parser)
    if ns.world_size < 1:  # the search would list no layout and call it "no layout fits"
        raise ValueError(f"--world-size must be >= 1, got {ns.world_size}")
    if not (math.isfinite(ns.device_gb) and ns.device_gb > 0):
        raise ValueError(f"--device-gb must be a finite number > 0, got {ns.device_gb:g}")
    if not (math.isfinite(ns.host_gb) and ns.host_gb >= 0):
        raise ValueError(f"--host-gb must be a finite number >= 0 (0: no limit), got {ns.host_gb:g}")
    assumptions = getattr(args, "time", None) or from_namespace(TimeAssumptions, ns)
    args.images = image_mix(ns)
    if not ns.search:
        return ns, args, assumptions, validate_plan(args, ns.world_size)
    check_plannable(args, model_config(args))
    if args.memory.trace:
        raise ValueError("--trace traces one layout: plan it without --search (its flags from the search's row)")
    if ns.top < 1:
        raise ValueError(f"--top must be >= 1, got {ns.top}")
    if ns.reserve_gb is not None and not 0 <= ns.reserve_gb < ns.device_gb:
        raise ValueError(f"--reserve-gb must be >= 0 and below --device-gb {ns.device_gb:g}, got {ns.reserve_gb:g}")
    return ns, args, assumptions, None


def main(argv=None) -> int:
    try:
        ns, args, assumptions, layout = planned(argv)
        if layout is None:
            return search_report(args, ns.world_size, device_gb=ns.device_gb, host_gb=ns.host_gb,
                                 assumptions=assumptions, top=ns.top, as_json=ns.json, reserve_gb=ns.reserve_gb)
    except ValueError as e:
        print(f"plan_memory.py: error: {e}", file=sys.stderr)
        return 2
    return report(args, layout, as_json=ns.json, device_gb=ns.device_gb, assumptions=assumptions)


if __name__ == "__main__":
    sys.exit(main())
