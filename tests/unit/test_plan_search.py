"""``tools/plan_memory.py --search``: every layout of a world size, those that fit ranked by
predicted tokens/s per GPU; for the recipe's flags the top row fits an H200 without copying
weights to the GPU for each of several micro-batches."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from models.step37 import Step37Config
from tests.planner_inputs import inputs
from training.planner.search import RESERVE_SHARE, candidates, search

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = ["--model-preset", "step37-flash", "--seq-length", "8192", "--global-batch-size", "32",
          "--bf16", "--optimizer", "muon", "--muon-momentum", "0", "--overlap-moe-expert-parallel-comm"]


def test_recipe_search_prints_a_ranked_table_whose_top_row_fits_without_per_microbatch_copies(capsys):
    out = subprocess.run([sys.executable, "tools/plan_memory.py", "--search", "--world-size", "8", *RECIPE,
                          "--top", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    fit, total = map(int, re.match(r"(\d+) of (\d+) layouts on 8 GPUs fit 141 GB", lines[0]).groups())
    assert 0 < fit < total
    head = lines[1].split()
    assert head[:4] == ["#", "pp", "vpp", "ep"] and "tokens/s/GPU" in head and "weights/mb" in head
    rows = [l.split() for l in lines[2:7]]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5]
    tokens = [float(r[head.index("tokens/s/GPU")].replace(",", "")) for r in rows]
    assert tokens == sorted(tokens, reverse=True) and tokens[0] > 0
    top = dict(zip(head, rows[0]))
    # weights copied per micro-batch only where there is one micro-batch per step (the chunked
    # loss lets 8 packs fit: the experts cross PCIe for its forward and backward, once per step)
    assert float(top["GB/GPU"]) <= 141 and (top["weights/mb"] == "no" or top["M"] == "1")
    flags = lines[-1].split()
    assert lines[-2].startswith("plan_memory: fastest layout: ") and "tokens/s per GPU" in lines[-2]
    # the recipe (examples/step37_flash_8xh200_thd_sft.sh: these model, sequence, batch and
    # precision flags) runs this fastest fitting layout
    from tests.unit.test_plan_cli import recipe_flags

    recipe = recipe_flags("/unused/Step-3.7-Flash")
    assert flags and all(f in recipe for f in flags if f.startswith("--")), (flags, recipe)
    pairs = {f: v for f, v in zip(flags, flags[1:] + [""]) if f.startswith("--") and not v.startswith("--")}
    assert all(recipe[recipe.index(k) + 1] == v for k, v in pairs.items() if v), (pairs, recipe)
    assert flags[flags.index("--micro-batch-size") + 1] == top["mbs"]
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == top["pp"]
    # the printed flags pasted after the recipe's plan that layout: it fits, as fast as ranked
    # (in this process: the script itself just ran)
    from tools.plan_memory import main

    assert main(["--world-size", "8", *RECIPE, *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert all(r["fits"] for r in plan["ranks"])
    assert round(plan["time"]["tokens_per_s_per_gpu"]) == float(top["tokens/s/GPU"].replace(",", ""))


def test_search_covers_the_layouts_and_ranks_only_what_fits():
    cfg = Step37Config.preset("step37-flash")
    base = inputs(seq_length=8192, optimizer="muon", muon_momentum=0.0, bf16=True)
    todo = candidates(cfg, 8, base, 64)
    layouts = {(c.pp, c.vpp, c.ep) for c in todo}
    # PP divides 8; virtual stages only with a pipeline; EP divides DP (and the 288 experts)
    assert layouts == {(1, 1, e) for e in (1, 2, 4, 8)} | {(2, v, e) for v in (1, 2) for e in (1, 2, 4)} | \
        {(4, v, e) for v in (1, 2) for e in (1, 2)} | {(8, v, 1) for v in (1, 2)}
    assert {c.micro_batch_size for c in todo} == {1, 2, 4, 8}
    assert all(c.num_microbatches * c.micro_batch_size * c.dp == 64 for c in todo)
    assert all(c.num_microbatches % c.pp == 0 for c in todo if c.vpp > 1)
    # at DP 1 (PP8) nothing shards: no fsdp without offload, and no gather-once twins
    assert not [c for c in todo if c.dp == 1 and c.mode.data_parallel_sharding == "fsdp"
                and (c.mode.cpu_offload == "none" or c.mode.fsdp_gather_once)]
    rows = search(cfg, 8, base, 64, progress=False)
    assert len(rows) == len(todo)
    fitting = [r for r in rows if r.fits]
    room = 141 * (1 - RESERVE_SHARE)  # 7% left free for what the plan does not count
    assert fitting == rows[:len(fitting)] and all(r.device_gb <= room for r in fitting)
    assert all(r.device_gb > room for r in rows[len(fitting):])  # no host limit by default
    speeds = [r.tokens_per_s_per_gpu for r in fitting]
    assert speeds == sorted(speeds, reverse=True)
    # per-micro-batch weight copies happen exactly where offloaded shards are gathered per pass
    for r in rows:
        assert r.weights_per_microbatch == (r.mode.cpu_offload in ("all", "experts") and r.dp > 1
                                            and not r.mode.fsdp_gather_once)


def test_search_adds_cp_sizes_only_for_long_sequences():
    """At 8K every candidate is CP1 (the test above); at 128K on 8 GPUs CP 2, 4 and 8 join (shards
    of 64K, 32K and 16K tokens, at least CP_MIN_TOKENS), EP carved out of DP x CP, and a row's
    flags name its CP size."""
    from training.planner.search import cp_sizes

    assert cp_sizes(8, 8192) == [1] and cp_sizes(8, 131072) == [1, 2, 4, 8] and cp_sizes(4, 16384) == [1, 2]
    cfg = Step37Config.preset("step37-flash")
    base = inputs(seq_length=131072, optimizer="muon", muon_momentum=0.0, bf16=True)
    todo = candidates(cfg, 8, base, 8)
    assert {c.cp for c in todo} == {1, 2, 4, 8}
    assert {(c.pp, c.ep) for c in todo if c.cp == 8} == {(1, e) for e in (1, 2, 4, 8)}  # dp 1: EP from CP
    assert all(c.pp * c.dp * c.cp == 8 and (c.dp * c.cp) % c.ep == 0 for c in todo)


def test_search_keeps_a_reserve_free_and_says_so(capsys):
    """A layout fits only with the reserve left free (7% of the device by default, or
    --reserve-gb); the header says how much, and a reserve beyond the device is refused."""
    from tools.plan_memory import main

    flags = ["--search", "--world-size", "8", "--model-preset", "step37-flash", "--seq-length", "8192",
             "--global-batch-size", "32", "--bf16", "--optimizer", "muon", "--muon-momentum", "0", "--top", "1",
             "--json"]
    for extra, free in (([], 141 * 0.07), (["--reserve-gb", "30"], 30.0)):
        assert main(flags + extra) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["reserve_gb"] == pytest.approx(free)
        assert all(r["device_gb"] <= 141 - free for r in out["rows"] if r["fits"])
        assert any(141 - free < r["device_gb"] <= 141 for r in out["rows"] if not r["fits"])
    assert main(flags + ["--reserve-gb", "141"]) == 2
    assert "--reserve-gb must be >= 0 and below --device-gb 141, got 141" in capsys.readouterr().err
