"""The shipped recipes' predicted step, side by side: the 8 x H200 recipe before the one-node
work (``--cpu-offload optimizer``, one pack per micro-batch) beside today's
(``examples/step37_flash_8xh200_thd_sft.sh``, its flags read from the script), and the
search's best layout for 8 x H100, 16 x H200 and 16 x H100. Every number is a **prediction** of
``tools/plan_memory.py`` (today's planner, its default assumptions: 40% of peak, PCIe 35 GB/s,
NVLink 150 GB/s, host 52 GB/s per rank); none is a measurement. The one-GPU proxy of a recipe
rank, measured, is a part of ``bash tools/gpu_check.sh`` (a lent GPU only).

Then each single-node recipe's busiest rank, planned beside its traced peak (``--trace``: the
real step of that rank on fake tensors, docs/memory.md "The Traced Peak"; about a minute each).

    python benchmarks/bench_recipe_plan.py            # about 10 min on 2 cores (searches, traces)
    python benchmarks/bench_recipe_plan.py --no-search --no-trace
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.plan_memory import planned  # noqa: E402
from training.planner.run import plan_inputs, search_plan  # noqa: E402
from training.planner.search import evaluate  # noqa: E402
from training.recipe import recipe_flags as read_recipe  # noqa: E402
from training.planner.timing import TimeAssumptions, peak_tflops  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "step37_flash_8xh200_thd_sft.sh")
MODEL = "--model-preset step37-flash --seq-length 8192 --bf16 --optimizer muon --muon-momentum 0"
SEED = ("--pipeline-model-parallel-size 1 --expert-model-parallel-size 8 --data-parallel-sharding fsdp "
        "--cpu-offload optimizer --recompute-granularity full --micro-batch-size 1")
HOST_GB = 2000.0  # a DGX H200 / H100 node's host memory
# single-node recipes: (label, script, preset for --hf-config, GB per GPU, planner-only flags)
TRACED = (("Step-3.7-Flash text, 8 x H200", "step37_flash_8xh200_thd_sft.sh", "step37-flash", 141.0, ""),
          ("Step-3.7-Flash text, 8 x H100", "step37_flash_8xh100_thd_sft.sh", "step37-flash", 80.0, ""),
          ("Step-3.7-Flash LoRA, 8 x H200", "step37_flash_8xh200_lora_sft.sh", "step37-flash", 141.0, ""),
          ("Step-3.7-Flash LoRA, 8 x H100", "step37_flash_8xh100_lora_sft.sh", "step37-flash", 80.0, ""),
          ("Step-3.7-Flash image + text, 8 x H200", "step37_flash_8xh200_vlm_sft.sh", "step37-flash-vlm", 141.0,
           "--image-token-share 0.25 --image-crops-per-image 4"),
          ("Step-3.7-Flash 128K CP, 8 x H200", "step37_flash_8xh200_128k_cp_sft.sh", "step37-flash", 141.0, ""),
          ("Qwen3-30B-A3B, 8 x H200", "qwen3_30b_a3b_8xh200_thd_sft.sh", "qwen3-30b-a3b", 141.0, ""))
PATHS = {"--hf-config", "--load-hf", "--data-path", "--tokenizer-type", "--tokenizer-model", "--log-dir", "--save",
         "--load"}  # what a plan does not read (the model comes from the preset)


def recipe_flags(path: str = RECIPE) -> str:
    """The layout and batch flags of the recipe's torchrun command (data and paths dropped)."""
    words = read_recipe(path, {"HF": "/hf", "DATA": "/data", "OUT": "/out"})
    keep, out = ("--pipeline", "--expert", "--data-parallel-sharding", "--cpu-offload", "--fsdp",
                 "--optimizer-in", "--store-param", "--recompute", "--offload-recompute", "--micro-batch",
                 "--global-batch", "--overlap-moe"), []
    for i, w in enumerate(words):
        if w.startswith(keep):
            out.append(w)
            if i + 1 < len(words) and not words[i + 1].startswith("--"):
                out.append(words[i + 1])
    return " ".join(out)


def _row(flags: str, world: int, device_gb: float):
    _, args, _, layout = planned(shlex.split(f"--world-size {world} --device-gb {device_gb:g} {flags}"))
    a = TimeAssumptions()
    return evaluate(layout.config, plan_inputs(args, layout, device_gb), a, peak_tflops(None),
                    args.data.global_batch_size, HOST_GB)


def _best(world: int, device_gb: float, gbs: int, extra: str = ""):
    _, args, _, _ = planned(shlex.split(f"--world-size {world} --global-batch-size {gbs} {MODEL} {extra} --search"))
    rows = search_plan(args, world, device_gb=device_gb, host_gb=HOST_GB, progress=False)
    fitting = [r for r in rows if r.fits]
    return fitting[0] if fitting else None


def training_flags(script: str, preset: str) -> list[str]:
    """Every flag of the recipe's torchrun line but its paths, the model from ``preset``."""
    words, out, i = read_recipe(os.path.join(ROOT, "examples", script), {"HF": "/hf", "DATA": "/d", "OUT": "/o"}), [], 0
    while i < len(words):
        skip = words[i] in PATHS
        i += 1 + (skip and i + 1 < len(words) and not words[i + 1].startswith("--"))
        if not skip:
            out.append(words[i - 1])
    return ["--model-preset", preset, *out]


def traced_table() -> None:
    """Each single-node recipe's busiest rank: planned and traced device peaks."""
    from tools.plan_memory import planned
    from training.planner.memory import plan
    from training.planner.run import plan_inputs
    from training.trace.report import chosen_ranks
    from training.trace.runner import trace_rank

    print("\nsingle-node recipes, busiest rank: planned (tools/plan_memory.py) beside traced (--trace: the real "
          "step on fake tensors), GB")
    print(f"{'recipe':<42}{'GB/GPU':>8}{'planned':>9}{'traced':>8}{'diff':>8}{'host pl.':>9}{'host tr.':>9}{'trace s':>9}")
    for label, script, preset, gb, extra in TRACED:
        _, args, _, layout = planned(["--world-size", "8", "--device-gb", f"{gb:g}",
                                      *training_flags(script, preset), *shlex.split(extra)])
        ranks = plan(layout.config, plan_inputs(args, layout, gb))
        rank = chosen_ranks(None, ranks, layout)[0]
        c = layout.sizes.coords(rank)
        p = next(r for r in ranks if (r.pp_rank, r.ep_rank) == (c["pp"], c["ep"]))
        t = trace_rank(args, layout, rank)
        print(f"{label:<42}{gb:>8g}{p.device_total / 1e9:>9.1f}{t.device_total / 1e9:>8.1f}"
              f"{(t.device_total - p.device_total) / p.device_total:>+8.1%}{p.host_total / 1e9:>9.1f}"
              f"{t.host_total / 1e9:>9.1f}{t.seconds:>9.0f}"
              + (f"  not a bound: {t.overfreed / 1e9:.1f} GB freed unseen" if t.overfreed else ""), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-search", action="store_true", help="only the two 8 x H200 recipes")
    ap.add_argument("--no-trace", action="store_true", help="leave out the recipes' traced peaks")
    ns = ap.parse_args(argv)
    rows = [("8 x H200 before: seed recipe, 64 packs", 8, 141.0, _row(f"{MODEL} {SEED} --global-batch-size 64", 8, 141.0)),
            ("8 x H200 before: seed recipe, 32 packs", 8, 141.0, _row(f"{MODEL} {SEED} --global-batch-size 32", 8, 141.0)),
            ("8 x H200 now: the recipe, 32 packs", 8, 141.0, _row(f"{MODEL} {recipe_flags()}", 8, 141.0))]
    if not ns.no_search:
        # the 8 x H100 recipe's search weighs the all-to-all overlap; the two-node recipe's does not
        for label, world, gb, extra in (("8 x H100: search's best", 8, 80.0, "--overlap-moe-expert-parallel-comm"),
                                        ("16 x H200: search's best", 16, 141.0, ""),
                                        ("16 x H100: search's best", 16, 80.0, "")):
            rows.append((label + ", 32 packs", world, gb, _best(world, gb, 32, extra)))
    print("Step-3.7-Flash SFT, seq 8192, --bf16, Muon momentum 0: predicted by tools/plan_memory.py (not measured)")
    print(f"{'layout':<42}{'GPUs':>5}{'GB/GPU':>8}{'spare':>7}{'host GB/node':>13}{'step s':>8}"
          f"{'tokens/s/GPU':>13}{'MFU':>7}")
    for label, world, gb, r in rows:
        if r is None:
            print(f"{label:<42}{world:>5}   nothing fits {gb:g} GB")
            continue
        print(f"{label:<42}{world:>5}{r.device_gb:>8.1f}{gb - r.device_gb:>7.1f}{r.host_gb_per_node:>13.0f}"
              f"{r.step_s:>8.1f}{r.tokens_per_s_per_gpu:>13,.0f}{r.mfu:>7.1%}")
    for label, world, gb, r in rows:
        if r is not None:
            print(f"  {label}: {r.flags()}")
    now, before = rows[2][3], rows[1][3]
    print(f"bench_recipe_plan: the recipe predicts {now.mfu:.1%} MFU at 32 packs per step against {before.mfu:.1%} "
          f"for the seed's layout ({before.step_s / now.step_s:.1f}x the tokens per second); the issue's "
          f"target was 20%")
    if not ns.no_trace:
        traced_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
