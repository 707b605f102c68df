"""tools/gpu_check.sh on a CPU: without CUDA it exits 2 and runs nothing; with fake parts (the
one way past the CUDA check) it runs each under its own timeout, kills a part that hangs (and
what it started), writes each result as that part ends, stops starting parts when the budget is
spent, and prints one table."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tools import gpu_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the check would run")
def test_without_cuda_it_exits_2_and_runs_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_FAKE_PARTS"}
    out = subprocess.run(["bash", "tools/gpu_check.sh", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing run" in out.stderr
    assert not os.listdir(tmp_path)


def _alive(pid: int) -> bool:
    """Running (a killed process whose parent died may linger as a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hung_part_is_killed_and_reported_and_the_others_still_report(tmp_path):
    py = sys.executable
    child = tmp_path / "child.pid"
    results = tmp_path / "out" / "results.jsonl"
    parts = [
        {"key": "ok", "name": "a part that passes", "timeout": 30,
         "cmd": [py, "-c", "import json, sys; print('measured 3 things'); "
                           "json.dump({'headline': 'ok: 3 things', 'skipped': ['no transformers']}, open(sys.argv[1], 'w'))",
                 "{json}"]},
        {"key": "hangs", "name": "a part that sleeps past its timeout", "timeout": 1,
         "cmd": [py, "-c", "import subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); "
                           f"open({str(child)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(300)"]},
        {"key": "after", "name": "a part that sees the hung part's result already written", "timeout": 30,
         "cmd": [py, "-c", "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]; "
                           "assert [r['key'] for r in rows] == ['ok', 'hangs'], rows; "
                           "assert rows[1]['status'].startswith('hung'), rows; sys.exit(3)", str(results)]},
    ]
    env = {**os.environ, "GPU_CHECK_FAKE_PARTS": json.dumps(parts)}
    out = subprocess.run(["bash", "tools/gpu_check.sh", "--out", str(tmp_path / "out")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    rows = [json.loads(l) for l in results.read_text().splitlines()]
    assert [(r["key"], r["status"]) for r in rows] == [
        ("ok", "passed"), ("hangs", "hung (killed after 1 s)"), ("after", "failed (exit 3)")]
    assert rows[0]["headline"] == "ok: 3 things" and rows[0]["skipped"] == ["no transformers"]
    assert rows[1]["headline"] == "started"  # the last line it printed
    assert "[hangs] started" in out.stdout and "measured 3 things" in (tmp_path / "out" / "ok.log").read_text()
    assert not _alive(int(child.read_text()))  # what the hung part started was killed with it
    table = out.stdout[out.stdout.index("\npart "):]
    assert re.search(r"^hangs +hung \(killed after 1 s\) +\d+\.\d +a part that sleeps", table, re.M), table
    assert re.search(r"^ +skipped: no transformers$", table, re.M), table
    assert table.strip().splitlines()[-1].startswith("gpu_check: 1 passed, 2 failed in ")


def test_a_part_the_budget_leaves_no_time_for_is_not_started(tmp_path):
    part = gpu_check.Part("late", "never started", ["false"], 30)
    row = gpu_check.run_part(part, str(tmp_path), gpu_check.MIN_START - 1)
    assert row["status"] == f"not run ({gpu_check.MIN_START - 1:.0f} s of the budget left)"
    assert json.loads((tmp_path / "results.jsonl").read_text())["status"] == row["status"]
    assert not (tmp_path / "late.log").exists()


def test_an_earlier_checks_json_is_not_read_as_this_ones(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"headline": "passed last week"}))
    part = gpu_check.Part("old", "dies before writing its JSON", [sys.executable, "-c", "print('died'); raise SystemExit(4)"], 30)
    row = gpu_check.run_part(part, str(tmp_path), 60)
    assert row["status"] == "failed (exit 4)" and row["headline"] == "died"


def test_the_parts_fit_the_budget_order_and_take_the_model():
    parts = gpu_check.gpu_parts("qwen3-30b-a3b", ["--compile"])
    keys = [p.key for p in parts]
    assert keys[:2] == ["build", "env"] and keys.index("a") < keys.index("b") < keys.index("c") < keys.index("g")
    for p in parts:
        if p.key in ("a", "b", "c", "d", "e", "i", "h", "g"):  # the model-specific ones
            assert p.cmd[p.cmd.index("--model-preset") + 1] == "qwen3-30b-a3b", p
    assert parts[keys.index("g")].cmd[-1] == "--compile"
    assert gpu_check.BUDGET + 30 <= 8 * 60  # start-up and the table inside 8 minutes
