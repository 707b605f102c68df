"""Parts (h) and (h100) of the GPU check, the one-GPU proxies of the 8 x H200 and 8 x H100 recipes'
ranks, run their whole path on the CPU at tiny width (``--tiny``: the tiny preset's first MoE
layers with one EP4 rank's experts, the recipe's flags through pretrain_step37.py, the planner's
EP4 rank beside it); their flags are the recipes'."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from benchmarks.gpu_parts import proxy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("recipe", sorted(proxy.RECIPES))
def test_the_proxy_runs_the_recipe_and_prints_the_plan_beside_it(tmp_path, recipe):
    path = tmp_path / "h.json"
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_parts.proxy", "--tiny", "--steps", "3", "--json",
                          str(path), "--recipe", recipe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(path.read_text())
    assert r["layers"] == [1, 2, 3] and r["ep"] == 4 and r["measured"]["steps"] == 3
    assert r["measured"]["step_s"] > 0 and r["planned"]["step_s"] > 0
    # the prediction, computed independently: tools/plan_memory.py's JSON for the recipe's flags on
    # the same four layers at EP4 (the proxy's config, sliced as the proxy documents it), less the
    # all-to-all and data-parallel collectives a one-GPU run does not make
    expected = _planner_json(tmp_path, recipe)
    seconds = expected["time"]["ranks"][0]["seconds"]
    want_step = expected["time"]["step_s"] - seconds["all-to-all"] - seconds["dp comm"]
    planned = r["planned"]
    assert planned["step_s"] == pytest.approx(want_step, rel=1e-9) and want_step < expected["time"]["step_s"]
    rank = expected["ranks"][0]
    assert planned["device_gib"] == pytest.approx((rank["device_total"] - rank["device"]["all-to-all buffers"])
                                                  / 2**30, rel=1e-9)
    here = r["planned_one_gpu"]  # the run itself at EP1: nothing to exclude
    assert here["all_to_all_s"] == 0 and here["step_s"] > 0 and "for this one-GPU run itself" in out.stdout
    assert re.search(r"^step s +\d+\.\d\d +\d+\.\d\d$", out.stdout, re.M), out.stdout
    assert "less its all-to-all" in out.stdout
    assert r["headline"].startswith(f"proxy {recipe} EP4 rank (3 layers): step ")
    assert r["flags"] == proxy.RECIPES[recipe][1] and f"the flags of {proxy.RECIPES[recipe][0]}" in out.stdout
    assert [c["what"] for c in r["compare"]] == ["step", "device memory: peak allocated",
                                                 "device memory: peak reserved", "MFU"]


def _planner_json(tmp_path, recipe: str) -> dict:
    """``tools/plan_memory.py --json`` for the proxy's planned layout: the tiny preset's first
    MoE layers with all experts, the recipe's flags at EP4 on 4 ranks, 4 packs of 128 tokens."""
    from benchmarks.model_slice import moe_layers, slice_config
    from models import registry

    full = registry.resolve("tiny")[1]
    cfg, _ = slice_config(full, layers=moe_layers(full)[:proxy.LAYERS])
    path = tmp_path / "planned.json"
    path.write_text(json.dumps(cfg.to_hf()))
    out = subprocess.run([sys.executable, "tools/plan_memory.py", "--world-size", "4", "--json", "--hf-config",
                          str(path), *proxy.RECIPES[recipe][1], "--seq-length", "128", "--micro-batch-size",
                          str(proxy.MICRO_BATCH), "--global-batch-size", str(4 * proxy.MICRO_BATCH),
                          "--expert-model-parallel-size", "4"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("recipe", sorted(proxy.RECIPES))
def test_the_proxy_flags_are_the_recipes(recipe):
    path, flags = proxy.RECIPES[recipe]
    words = shlex.split(open(os.path.join(ROOT, path)).read().replace("\\\n", " "), comments=True)
    for i, flag in enumerate(flags):
        if not flag.startswith("--"):
            continue  # a value: checked with its flag
        assert flag in words, flag
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            assert words[words.index(flag) + 1] == flags[i + 1], (flag, flags[i + 1])
    # and every flag of the recipe that shapes a rank's step is the proxy's
    shaping = {"--fsdp-gather-once", "--recompute-chunks", "--offload-recompute-inputs", "--cpu-offload",
               "--optimizer-in-backward", "--recompute-granularity", "--data-parallel-sharding", "--bf16"}
    assert {w for w in words if w in shaping} == {f for f in flags if f in shaping}
    assert words[words.index("--micro-batch-size") + 1] == str(proxy.MICRO_BATCH)
    assert words[words.index("--expert-model-parallel-size") + 1] == "8"
