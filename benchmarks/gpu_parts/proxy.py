"""Parts (h) and (h100): a one-GPU proxy of one rank of a recipe, measured beside the planner's
prediction for that rank scaled to the layers the proxy holds. ``--recipe 8xh200`` (h, the
default: ``examples/step37_flash_8xh200_thd_sft.sh``: EP8 on 8 x H200, --bf16, FSDP with fp32
masters on the GPU, the optimizer in the backward, full recompute a pack at a time with its
inputs in host memory, Muon with momentum 0, micro-batches of 4 packs of 8192 tokens) or
``--recipe 8xh100`` (h100: ``examples/step37_flash_8xh100_thd_sft.sh``: the same with host
masters, ``--cpu-offload masters``; the full model's prediction is 73.0 GB a GPU and 22.3% MFU).
Neither runs the recipes' ``--overlap-moe-expert-parallel-comm``: one GPU has no all-to-all.

The proxy is ``pretrain_step37.py`` itself on one GPU with the recipe's flags, on a model cut from
the preset: its first four MoE layers (Step-3.7-Flash: layers 3-6, three sliding-window and one
full-attention layer, the model's 3:1 mix) at full width, each with 36 experts (an EP8 rank's
share of 288; the router chooses top-8 among them, so the experts get the rows an EP8 rank's get
on average: T x top-k), the embedding and the head, no MTP (part (d) measures those). Why four
layers and not 45: the host. Under host masters (``8xh100``) the proxy keeps fp32 masters, bf16
staging and AdamW state in host memory for all it holds (about 5.5 GB per layer, 17 GB for the embedding and head), and the lent
machine has 128 GiB; four layers also keep start-up and the steps within the part's two minutes.

The prediction is the planner's (``training/planner/memory.py``, ``training/planner/timing.py``) for the
same flags at EP8 on 8 GPUs, on the same four layers with all 288 experts (each rank's share 36):
its step time less what the proxy cannot do on one GPU, the all-to-all and the data-parallel
collectives (FSDP's gathers and reduce-scatters of the dense weights), and its device memory less
the all-to-all buffers. Data: synthetic documents (log-normal lengths, median 300 tokens) written
as an indexed dataset. Measured: the median of the steps after the first (``metrics.jsonl``),
the run's peak device memory, the trainer's own MFU."""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.gpu_parts import common

import numpy as np  # noqa: E402

# the flags that shape a rank's step of examples/step37_flash_8xh200_thd_sft.sh (its
# --overlap-moe-expert-parallel-comm is left out: no all-to-all on one GPU)
RECIPE = ["--bf16", "--data-parallel-sharding", "fsdp", "--optimizer-in-backward", "--recompute-granularity",
          "full", "--recompute-chunks", "4", "--offload-recompute-inputs", "--optimizer", "muon",
          "--muon-momentum", "0", "--lr", "2e-4", "--adamw-lr", "1e-5", "--weight-decay", "0.1",
          "--clip-grad", "1.0", "--mtp-loss-scale", "0.3", "--moe-bias-update-rate", "0"]
# examples/step37_flash_8xh100_thd_sft.sh: the same with host masters
RECIPES = {"8xh200": ("examples/step37_flash_8xh200_thd_sft.sh", RECIPE),
           "8xh100": ("examples/step37_flash_8xh100_thd_sft.sh", RECIPE[:3] + ["--cpu-offload", "masters"] + RECIPE[3:])}
MICRO_BATCH = 4  # packs per micro-batch, one micro-batch per rank and step
LAYERS = 4


def expert_parallel(cfg, tiny: bool) -> int:
    """The recipe's EP8; the tiny preset's 8 experts of top-2 take EP4 (2 experts a rank)."""
    return 4 if tiny else 8


def configs(preset: str, tiny: bool):
    """(the config the proxy runs: LAYERS MoE layers with an EP rank's experts; the one the
    planner sees: the same layers with all experts; their global indices; EP size)."""
    from benchmarks.model_slice import moe_layers, slice_config
    from models import registry

    full = registry.resolve(preset)[1]
    planned, idx = slice_config(full, layers=moe_layers(full)[:LAYERS])
    ep = expert_parallel(full, tiny)
    if planned.num_experts % ep or planned.num_experts // ep < planned.num_experts_per_tok:
        raise SystemExit(f"{preset}: {planned.num_experts} experts do not split into {ep} shares of top-"
                         f"{planned.num_experts_per_tok} or more")
    return dataclasses.replace(planned, num_experts=planned.num_experts // ep), planned, idx, ep


def write_data(prefix: str, tokens: int, seed: int) -> None:
    from data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    n = 0
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        while n < tokens:
            length = int(np.clip(rng.lognormal(np.log(300), 1.0), 2, 8192))
            w.add(rng.integers(0, 250, length))  # the byte tokenizer's ids
            n += length


def _flags(config_path: str, seq: int, gbs: int, ep: int, recipe: str = "8xh200") -> list[str]:
    return ["--hf-config", config_path, *RECIPES[recipe][1], "--seq-length", str(seq),
            "--micro-batch-size", str(MICRO_BATCH),
            "--global-batch-size", str(gbs), "--expert-model-parallel-size", str(ep)]


def measure(run_cfg, seq: int, steps: int, workdir: str, seed: int = 0, recipe: str = "8xh200") -> dict:
    """pretrain_step37.py with the recipe's flags on this one device; its logged steps."""
    path = os.path.join(workdir, "proxy_config.json")
    with open(path, "w") as f:
        json.dump(run_cfg.to_hf(), f)
    prefix = os.path.join(workdir, "synth_text_document")
    write_data(prefix, 2 * steps * MICRO_BATCH * seq, seed)
    log = os.path.join(workdir, "log")
    cmd = [sys.executable, "pretrain_step37.py", *_flags(path, seq, MICRO_BATCH, 1, recipe), "--data-path", prefix,
           "--train-iters", str(steps), "--log-interval", "1", "--log-dir", log, "--eval-iters", "0",
           "--no-tensorboard"]
    print("proxy: " + " ".join(cmd[1:]), flush=True)
    rc = subprocess.run(cmd, cwd=common.ROOT).returncode
    rows = [json.loads(line) for line in open(os.path.join(log, "metrics.jsonl"))] if rc == 0 else []
    later = rows[1:] or rows
    return {"rc": rc, "steps": len(rows),
            "step_s": statistics.median(r["step_ms"] for r in later) / 1e3 if later else None,
            "peak_gib": max((r["peak_mem_gib"] for r in rows), default=None),
            "peak_reserved_gib": max((r["peak_reserved_gib"] for r in rows if r.get("peak_reserved_gib") is not None),
                                     default=None),
            "mfu": statistics.median(r["mfu"] for r in later) if later and later[0]["mfu"] is not None else None,
            "tflops": statistics.median(r["tflops_per_gpu"] for r in later) if later else None}


def predict(planned_cfg, seq: int, ep: int, workdir: str, recipe: str = "8xh200") -> dict:
    """The planner's EP rank of the recipe on these layers, less what one GPU does not do. With
    ``ep`` 1 (and the proxy's own config): the planner's view of the one-GPU run itself, which
    also runs the Newton-Schulz of every dense matrix (the EP rank runs 1/ep of it, the split)
    and holds the dense weights whole."""
    from train_args import parse, validate
    from training.planner.memory import GB, plan
    from training.planner.run import plan_inputs
    from training.planner.timing import plan_time, peak_tflops

    path = os.path.join(workdir, f"planned_config_ep{ep}.json")
    with open(path, "w") as f:
        json.dump(planned_cfg.to_hf(), f)
    args = parse(_flags(path, seq, MICRO_BATCH * ep, ep, recipe) + ["--data-path", "unused"])
    layout = validate(args, world=ep, check_files=False)
    inp = plan_inputs(args, layout)
    rank = plan(layout.config, inp)[0]
    st = plan_time(layout.config, inp, None, peak_tflops(None), args.data.global_batch_size)
    sec = st.ranks[0].seconds
    excluded = sec["all-to-all"] + sec["dp comm"]
    step = st.step_s - excluded
    return {"step_s": step, "planned_step_s": st.step_s, "all_to_all_s": sec["all-to-all"], "dp_comm_s": sec["dp comm"],
            "breakdown": {k: v for k, v in sec.items() if v}, "mfu": st.mfu * st.step_s / step,
            "device_gib": (rank.device_total - rank.device["all-to-all buffers"]) * 1.0 / 2**30,
            "device_gb_planned": rank.device_total / GB, "peak_tflops": st.peak_tflops}


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--steps", type=int, default=4, help="training steps (the first is not timed)")
        ap.add_argument("--recipe", choices=sorted(RECIPES), default="8xh200",
                        help="whose rank: " + ", ".join(f"{k} ({v[0]})" for k, v in sorted(RECIPES.items())))

    args = common.parse(__doc__.split("\n\n")[0], argv, extra=extra)
    device = common.device_for(args)
    if device is None:
        return common.NO_CUDA
    run_cfg, planned_cfg, idx, ep = configs(common.preset_of(args), args.tiny)
    seq = 128 if args.tiny else 8192
    with tempfile.TemporaryDirectory(prefix="gpu_check_proxy_") as workdir:
        pred = predict(planned_cfg, seq, ep, workdir, args.recipe)
        here = predict(run_cfg, seq, 1, workdir, args.recipe)
        got = measure(run_cfg, seq, args.steps, workdir, args.seed, args.recipe)
    kinds = [planned_cfg.layer_types[i] for i in range(len(idx))] if hasattr(planned_cfg, "layer_types") else []
    print(f"proxy of one EP{ep} rank: layers {idx} ({', '.join(kinds)}) at full width with "
          f"{run_cfg.num_experts} of {planned_cfg.num_experts} experts each, embedding and head; "
          f"{MICRO_BATCH} packs of {seq} tokens per step; the flags of {RECIPES[args.recipe][0]}")
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{'':<22}{'measured':>10}{'planned':>10}")
    print(f"{'step s':<22}{f(got['step_s'], '.2f'):>10}{pred['step_s']:>10.2f}")
    print(f"{'peak device GiB':<22}{f(got['peak_gib'], '.1f'):>10}{pred['device_gib']:>10.1f}")
    print(f"{'peak reserved GiB':<22}{f(got['peak_reserved_gib'], '.1f'):>10}{pred['device_gib']:>10.1f}")
    print(f"{'MFU':<22}{f(got['mfu'] and 100 * got['mfu'], '.1f'):>9}%{100 * pred['mfu']:>9.1f}%")
    print(f"planned: the EP{ep} rank's step {pred['planned_step_s']:.2f} s less its all-to-all "
          f"{pred['all_to_all_s']:.2f} s and data-parallel collectives {pred['dp_comm_s']:.2f} s (a one-GPU proxy "
          f"runs neither); by part: " + ", ".join(f"{k} {v:.2f}" for k, v in pred["breakdown"].items()))
    print(f"planned memory: {pred['device_gb_planned']:.1f} GB on the rank less its all-to-all buffers; the rank "
          f"also holds 1/{ep} of the dense weights' bf16 shards beside their gathered copies (the proxy holds them once)")
    print(f"planned for this one-GPU run itself (every dense matrix's Newton-Schulz, no split; dense weights "
          f"whole): step {here['step_s']:.2f} s, {here['device_gib']:.1f} GiB, MFU {100 * here['mfu']:.1f}%")
    passed = got["rc"] == 0 and got["step_s"] is not None
    ratio = f", {got['step_s'] / pred['step_s']:.2f}x the plan" if passed else ""
    headline = (f"proxy {args.recipe} EP{ep} rank ({len(idx)} layers): step {f(got['step_s'], '.2f')} s vs planned "
                f"{pred['step_s']:.2f} s{ratio}; peak {f(got['peak_gib'], '.1f')} GiB (reserved "
                f"{f(got['peak_reserved_gib'], '.1f')}) vs {pred['device_gib']:.1f}; "
                f"MFU {f(got['mfu'] and 100 * got['mfu'], '.1f')}% vs {100 * pred['mfu']:.1f}%"
                + ("" if passed else f"; the training run FAILED (exit {got['rc']})"))
    compare = [{"what": "step", "measured": got["step_s"], "planned": pred["step_s"], "unit": "s"},
               *common.memory_compare("device memory", {"peak_allocated_gib": got["peak_gib"],
                                                        "peak_reserved_gib": got["peak_reserved_gib"]},
                                      pred["device_gib"]),
               {"what": "MFU", "measured": got["mfu"], "planned": pred["mfu"]}]
    return common.finish(args, {"part": "h" if args.recipe == "8xh200" else "h100", "recipe": args.recipe,
                                "flags": RECIPES[args.recipe][1], "passed": passed, "layers": idx, "ep": ep,
                                "measured": got,
                                "planned": pred, "planned_one_gpu": here, "headline": headline, "compare": compare})


if __name__ == "__main__":
    sys.exit(main())
