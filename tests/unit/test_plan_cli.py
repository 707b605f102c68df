"""The planner takes a training command as it is: the recipe's torchrun flags pasted after
``tools/plan_memory.py --world-size 8`` plan that run, one JSON entry per rank, and agree with
``pretrain_step37.py --dry-run 8`` (one code path)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from models.step37 import Step37Config
from training.recipe import recipe_flags as read_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "examples", "step37_flash_8xh200_thd_sft.sh")


def recipe_flags(hf_dir: str, recipe: str = RECIPE) -> list[str]:
    """The flags the recipe passes to pretrain_step37.py, with its variables filled in."""
    return read_recipe(recipe, {"HF": hf_dir, "DATA": "/nonexistent/sft_text_document", "OUT": "/nonexistent/out"})


def run(*cmd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_recipe_pasted_into_the_planner_plans_every_rank(tmp_path):
    hf = tmp_path / "Step-3.7-Flash"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(Step37Config.preset("step37-flash").to_hf()))
    flags = recipe_flags(str(hf))
    assert "--data-parallel-sharding" in flags and "--data-path" in flags  # pasted whole
    out = run("tools/plan_memory.py", "--world-size", "8", *flags, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    ranks = plan["ranks"]
    assert [r["rank"] for r in ranks] == list(range(8))
    assert {(r["pp_rank"], r["ep_rank"]) for r in ranks} == {(0, e) for e in range(8)}
    inp = plan["inputs"]
    assert (inp["pp"], inp["ep"], inp["dp"], inp["num_microbatches"]) == (1, 8, 8, 1)
    assert inp["data_parallel_sharding"] == "fsdp" and inp["bf16"] is True and inp["cpu_offload"] == "none"
    assert (inp["recompute_chunks"], inp["offload_recompute_inputs"], inp["optimizer_in_backward"]) == (4, True, True)
    assert inp["overlap_moe_expert_parallel_comm"] is True
    assert all(r["fits"] for r in ranks)
    time = plan["time"]
    assert len(time["ranks"]) == 1 and time["step_s"] == max(r["step_s"] for r in time["ranks"]) > 0
    assert time["tokens_per_s_per_gpu"] == pytest.approx(32 * 8192 / time["step_s"] / 8)

    table = run("tools/plan_memory.py", "--world-size", "8", *flags)
    dry = run("pretrain_step37.py", *flags, "--dry-run", "8")
    assert table.returncode == dry.returncode == 0, dry.stderr
    body = lambda s: [l for l in s.splitlines() if l.startswith("pp")]
    assert body(table.stdout) == body(dry.stdout) and len(body(dry.stdout)) == 8 + 1  # memory, time
    assert "predicted step" in dry.stdout and "tokens/s per GPU" in dry.stdout
    # that the recipe runs the search's fastest fitting layout for its model, sequence and batch
    # is checked on the search that tests/unit/test_plan_search.py runs (the same flags)


def test_planner_defaults_are_the_trainers_and_errors_name_the_flag(capsys):
    # in this process (the script's main; the test above runs the script itself): each
    # interpreter started would cost ~2.5 CPU-s of imports
    from tools.plan_memory import main

    def run_main(*argv) -> tuple[int, str, str]:
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse's errors
            rc = e.code
        out = capsys.readouterr()
        return rc, out.out, out.err

    rc, out, err = run_main("--world-size", "2", "--json")  # tiny model, fp32, adamw
    assert rc == 0, err
    inp = json.loads(out)["inputs"]
    assert (inp["bf16"], inp["optimizer"], inp["seq_length"]) == (False, "adamw", 4096)
    rc, _, err = run_main("--world-size", "3", "--pipeline-model-parallel-size", "2")
    assert rc == 2 and "world size 3 is not divisible" in err
    rc, _, err = run_main("--world-size", "4", "--global-batch-size", "6")
    assert rc == 2 and "--global-batch-size 6 must be a multiple" in err
    rc, _, err = run_main("--world-size", "2", "--assumed-mfu", "1.5")
    assert rc == 2 and "--assumed-mfu must be in (0, 1], got 1.5" in err


def _assert_recipe_is_the_search_top_row(tmp_path, config_class, preset: str, script: str,
                                         device_gb: float, gpu_gb: float = 141) -> list[str]:
    """The recipe's layout flags are the search's fastest fitting layout for its model, sequence,
    batch and precision (searched in this process for GPUs of ``gpu_gb``), on the busiest GPU
    within ``device_gb``."""
    from train_args import build_parser, sections
    from training.planner.run import plan_inputs
    from training.planner.search import search

    hf = tmp_path / preset
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(config_class.preset(preset).to_hf()))
    flags = recipe_flags(str(hf), os.path.join(ROOT, "examples", script))
    parser = build_parser(require_data=False)
    args = sections(parser.parse_args(flags), parser)
    top = search(config_class.from_hf(str(hf)), 8, plan_inputs(args, device_gb=gpu_gb), args.data.global_batch_size,
                 progress=False, host_gb=2000)[0]
    assert top.fits and top.device_gb <= device_gb
    wanted = top.flags().split()
    pairs = dict(zip(wanted[::2], wanted[1::2]))
    for flag in (f for f in wanted if f.startswith("--")):
        assert flag in flags, (flag, flags)
    assert all(flags[flags.index(k) + 1] == v for k, v in pairs.items() if not v.startswith("--")), (pairs, flags)
    return wanted


def test_qwen3_recipe_runs_the_search_top_row(tmp_path):
    """examples/qwen3_30b_a3b_8xh200_thd_sft.sh: its layout flags are the search's fastest fitting
    layout for its model, sequence, batch and precision (searched in this process)."""
    from models.qwen3_moe import Qwen3MoeConfig

    _assert_recipe_is_the_search_top_row(tmp_path, Qwen3MoeConfig, "qwen3-30b-a3b",
                                         "qwen3_30b_a3b_8xh200_thd_sft.sh", 141)


def test_h100_recipe_runs_the_80gb_search_top_row(tmp_path):
    """examples/step37_flash_8xh100_thd_sft.sh: the search's fastest fitting layout on 8 GPUs of
    80 GB, with 5 GB to spare: host masters with the layers recomputed a pack at a time."""
    wanted = _assert_recipe_is_the_search_top_row(tmp_path, Step37Config, "step37-flash",
                                                  "step37_flash_8xh100_thd_sft.sh", 80 - 5, gpu_gb=80)
    assert {"--recompute-chunks", "--offload-recompute-inputs", "--optimizer-in-backward"} <= set(wanted)


def test_long_context_recipe_runs_the_search_top_row(tmp_path):
    """examples/step37_flash_8xh200_128k_cp_sft.sh: its layout flags (context parallel 4 among
    them) are the search's fastest fitting layout at 131,072 tokens and 2 packs per step, with
    10 GB to spare."""
    wanted = _assert_recipe_is_the_search_top_row(tmp_path, Step37Config, "step37-flash",
                                                  "step37_flash_8xh200_128k_cp_sft.sh", 141 - 10)
    assert "--context-parallel-size" in wanted


@pytest.mark.parametrize("gpu, device_gb", [("H200", 141), ("H100", 80)])
def test_two_node_recipe_plans_16_ranks_that_fit(gpu, device_gb):
    """examples/step37_flash_2node_thd_sft.sh: torchrun over two nodes by c10d rendezvous, and the
    layout it runs for each GPU kind fits that GPU at 16 ranks with 10 GB to spare (the search's
    top rows: benchmarks/bench_recipe_plan.py prints them)."""
    from tools.plan_memory import build_planner_parser
    from train_args import sections, validate
    from training.planner.memory import GB, plan
    from training.planner.run import plan_inputs

    script = os.path.join(ROOT, "examples", "step37_flash_2node_thd_sft.sh")
    text = open(script).read()
    assert "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d" in text
    flags = read_recipe(script, {"HF": "/hf", "DATA": "/data", "OUT": "/out"})
    flags = [f for f in flags if f != "$ONCE"] + (["--fsdp-gather-once"] if gpu == "H200" else [])
    layout_flags = [f for f in flags if f not in ("--hf-config", "--load-hf", "/hf", "--tokenizer-model")]
    parser = build_planner_parser()
    ns = parser.parse_args(["--world-size", "16", "--model-preset", "step37-flash", *layout_flags])
    args = sections(ns, parser)
    layout = validate(args, 16, check_files=False)
    assert (layout.sizes.dp, layout.sizes.ep, layout.sizes.expert_dp, layout.num_microbatches) == (16, 8, 2, 1)
    ranks = plan(layout.config, plan_inputs(args, layout, device_gb))
    assert max(r.device_total for r in ranks) / GB <= device_gb - 10


FAMILY_RECIPES = {  # script: (preset, world size); their layouts are the search's top rows
    "moonlight_16b_a3b_8xh200_thd_sft.sh": ("moonlight-16b-a3b", 8),  # docs/deepseek-v3.md
    "deepseek_v3_4node_thd_sft.sh": ("deepseek-v3", 32),
    "deepseek_v3_8xh200_lora_sft.sh": ("deepseek-v3", 8),
    "glm45_air_8xh200_thd_sft.sh": ("glm-4.5-air", 8),  # docs/glm4-moe.md
    "glm45_4node_thd_sft.sh": ("glm-4.5", 32),
    "glm45_8xh200_lora_sft.sh": ("glm-4.5", 8),
}


@pytest.mark.parametrize("script", FAMILY_RECIPES)
def test_deepseek_and_glm_recipes_plan_what_their_comments_predict(tmp_path, script, capsys):
    """The DeepSeek-V3- and GLM-4.5-family recipes, planned in process at their world size:
    every rank fits, and the busiest GPU's GB, the step, tokens/s per GPU and MFU are the
    prediction their comments state (the searches behind their layouts take 20 s to a minute
    and a half: docs/deepseek-v3.md and docs/glm4-moe.md have their commands)."""
    import re

    from models.registry import resolve
    from tools.plan_memory import main

    preset, world = FAMILY_RECIPES[script]
    (tmp_path / "config.json").write_text(json.dumps(resolve(preset)[1].to_hf()))
    path = os.path.join(ROOT, "examples", script)
    flags = read_recipe(path, {"HF": str(tmp_path), "TOK": str(tmp_path), "DATA": "/data", "OUT": "/out"})
    assert main(["--world-size", str(world), *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["ranks"]) == world and all(r["fits"] for r in plan["ranks"])
    t = plan["time"]
    got = (f"{max(r['device_total'] for r in plan['ranks']) / 1e9:.1f} GB", f"{t['step_s']:.1f} s per step",
           f"{t['tokens_per_s_per_gpu']:,.0f} tokens/s", f"MFU {100 * t['mfu']:.1f}%")
    comment = re.sub(r"\s*\n#\s*", " ", open(path).read())
    assert all(g in comment for g in got), (got, script)
