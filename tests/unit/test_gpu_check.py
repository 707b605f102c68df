"""tools/gpu_check.sh on a CPU: without CUDA it exits 2 and runs nothing; with fake parts (the
one way past the CUDA check) it runs each under its own timeout, kills a part that hangs (and
what it started), writes each result as that part ends, stops starting parts when the budget is
spent, and prints one table."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tarfile
import time

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


def test_three_files_every_status_and_the_budget_kept(tmp_path):
    """Fake parts of every outcome under a 40 s budget: the passing part's headline, a hung part
    killed with what it started, a part that reads results.json (rewritten as each part ends) and
    fails, one whose timeout is larger than the whole budget and one larger than what is left
    (both "not run: budget"), and a small one after them that still runs. --out holds exactly the
    three files; the run ends inside the budget."""
    py = sys.executable
    child = tmp_path / "child.pid"
    out_dir = tmp_path / "out"
    parts = [
        {"key": "ok", "name": "a part that passes", "timeout": 5,
         "cmd": [py, "-c", "import json, sys; print('measured 3 things'); "
                           "json.dump({'headline': 'ok: 3 things', 'skipped': ['no transformers'], 'compare': "
                           "[{'what': 'peak GiB', 'measured': 1.5, 'planned': 2.0}]}, open(sys.argv[1], 'w'))",
                 "{json}"]},
        {"key": "hangs", "name": "a part that sleeps past its timeout", "timeout": 1,
         "cmd": [py, "-c", "import subprocess, sys, time; p = subprocess.Popen(['sleep', '300']); "
                           f"open({str(child)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(300)"]},
        {"key": "after", "name": "a part that sees the hung part's result already written", "timeout": 5,
         "cmd": [py, "-c", "import json, sys; rows = json.load(open(sys.argv[1]))['parts']; "
                           "assert [r['key'] for r in rows][:2] == ['ok', 'hangs'], rows; "
                           "assert rows[1]['status'].startswith('hung'), rows; "
                           "assert rows[2]['status'] == 'pending', rows; sys.exit(3)", str(out_dir / "results.json")]},
        {"key": "big", "name": "needs more than the whole budget", "timeout": 100, "cmd": ["true"]},
        {"key": "late", "name": "needs more than is left", "timeout": 24.5, "cmd": ["true"]},
        {"key": "last", "name": "small enough for what is left", "timeout": 5, "cmd": ["true"]},
    ]
    env = {**os.environ, "GPU_CHECK_FAKE_PARTS": json.dumps(parts)}
    t0 = time.monotonic()
    out = subprocess.run(["bash", "tools/gpu_check.sh", "--out", str(out_dir), "--budget", "40"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    wall = time.monotonic() - t0
    assert out.returncode == 1, out.stdout + out.stderr
    assert sorted(os.listdir(out_dir)) == ["logs.tar.gz", "results.json", "summary.txt"]
    res = json.loads((out_dir / "results.json").read_text())
    rows = res["parts"]
    assert [(r["key"], r["status"]) for r in rows] == [
        ("ok", "passed"), ("hangs", "hung (killed after 1 s)"), ("after", "failed (exit 3)"),
        ("big", "not run: budget"), ("late", "not run: budget"), ("last", "passed")]
    assert rows[0]["headline"] == "ok: 3 things" and rows[0]["skipped"] == ["no transformers"]
    assert rows[0]["compare"] == [{"what": "peak GiB", "measured": 1.5, "planned": 2.0}]
    assert rows[1]["headline"] == "started"  # the last line it printed
    assert rows[3]["headline"].startswith("needs 105 s, ") and rows[4]["need_s"] == 29.5
    assert res["elapsed_s"] <= res["budget_s"] == 40 and wall < 40
    assert not _alive(int(child.read_text()))  # what the hung part started was killed with it
    with tarfile.open(out_dir / "logs.tar.gz") as tar:
        names = tar.getnames()
        assert "measured 3 things" in tar.extractfile("gpu_check/ok.log").read().decode()
    assert {"gpu_check/ok.json", "gpu_check/hangs.log", "gpu_check/last.log"} <= set(names), names
    assert "gpu_check/big.log" not in names
    assert "[hangs] started" in out.stdout
    table = (out_dir / "summary.txt").read_text()
    assert out.stdout.rstrip().endswith(table.rstrip())  # the console ends with the table
    assert re.search(r"^hangs +hung \(killed after 1 s\) +\d+\.\d +a part that sleeps", table, re.M), table
    assert re.search(r"^big +not run: budget +0\.0 +needs more", table, re.M), table
    assert re.search(r"^ +skipped: no transformers$", table, re.M), table
    assert re.search(r"^ +peak GiB: measured 1\.5, planned 2$", table, re.M), table
    assert re.search(r"^gpu_check: 2 passed, 1 failed, 1 hung, 2 not run in \d+ s of a 40 s budget$",
                     table.strip().splitlines()[-1]), table


def test_an_earlier_checks_json_is_not_read_as_this_ones(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps({"headline": "passed last week"}))
    part = gpu_check.Part("old", "dies before writing its JSON", [sys.executable, "-c", "print('died'); raise SystemExit(4)"], 30)
    row = gpu_check.run_part(part, str(tmp_path), 60)
    assert row["status"] == "failed (exit 4)" and row["headline"] == "died"


def test_the_parts_are_in_the_order_of_what_they_decide_and_each_fits_the_budget():
    parts = gpu_check.gpu_parts("qwen3-30b-a3b", ["--compile"])
    keys = [p.key for p in parts]
    assert keys == ["build", "env", "t1", "t1c", "a", "b", "t2", "c", "j", "d", "e", "h", "h100", "i", "f1", "f2", "g"]
    for p in parts:
        if p.key in ("a", "b", "c", "d", "e", "i", "h", "h100", "g"):  # the model-specific ones
            assert p.cmd[p.cmd.index("--model-preset") + 1] == "qwen3-30b-a3b", p
        assert p.need <= gpu_check.BUDGET - gpu_check.FINISH, p  # each can run, alone
    assert parts[keys.index("g")].cmd[-1] == "--compile"
    assert parts[keys.index("h100")].cmd[parts[keys.index("h100")].cmd.index("--recipe") + 1] == "8xh100"
    assert gpu_check.BUDGET == 9 * 60  # of the lease's 15 minutes, 1-2 of which start the machine


def test_the_test_parts_select_every_cuda_test_once():
    """t1, t1c, t2, f1 and f2's pytest -k expressions split tests/gpu's tests: each in exactly one."""
    from _pytest.mark.expression import Expression

    tree = ast.parse(open(os.path.join(ROOT, "tests", "gpu", "test_cuda_paths.py")).read())
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    parts = {p.key: p for p in gpu_check.gpu_parts(None, [])}
    chosen = {k: {n for n in names if Expression.compile(parts[k].cmd[-1]).evaluate(lambda w, n=n: w in n)}
              for k in ("t1", "t1c", "t2", "f1", "f2")}
    assert sorted(n for c in chosen.values() for n in c) == sorted(names)
    assert chosen["f1"] == {"test_one_gpu_bf16_training_run"}
    assert chosen["t1c"] == {"test_compiled_layers_with_varlen_in_bf16_match_eager_without_recompiling"}
    assert chosen["t1"] == {"test_chunked_recompute_with_offloaded_inputs_on_cuda_equals_unchunked",
                            "test_optimizer_in_backward_on_its_own_stream_equals_the_step_after_the_backward",
                            "test_one_gpu_bf16_host_masters_training_run", "test_one_gpu_bf16_offloaded_training_run"}


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "-10", "0", "ten"])
def test_a_budget_that_is_not_a_finite_positive_number_is_refused(budget, tmp_path, monkeypatch, capsys):
    """--budget nan made every "is there time left" comparison false: no part was ever refused for
    the budget, so with the real parts the run outlived the lease before writing anything (and
    --budget -10 was taken too). Now a usage error naming the flag, before any part or file."""
    monkeypatch.setenv("GPU_CHECK_FAKE_PARTS", json.dumps([{"key": "ok", "timeout": 5, "cmd": ["true"]}]))
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--out", str(tmp_path / "out"), f"--budget={budget}"])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    want = "a finite number > 0, got " + (repr(budget) if budget == "ten" else budget)
    assert capsys.readouterr().err.splitlines()[-1].endswith(f": error: argument --budget: must be {want}")


def test_out_holding_other_files_or_unwritable_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """--out is checked before anything runs: a folder with files the check did not write is
    refused (a rerun replaces only its own three files, so it never deletes a user's), and so is
    one where nothing can be written (simulated: as root, chmod would not stop the probe)."""
    from core.checkpoint import out_dir

    for name in gpu_check.FILES:
        (tmp_path / name).write_text("an earlier check's")
    assert gpu_check.out_problem(str(tmp_path)) == ""
    (tmp_path / "notes.txt").write_text("mine")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"gpu_check: error: --out {tmp_path} holds files gpu_check did not write (notes.txt): choose an "
                   "empty or new folder\n")
    monkeypatch.setattr(out_dir, "_can_write", lambda folder: PermissionError(13, "Permission denied"))
    assert gpu_check.main(["--out", str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err.endswith("cannot write there (its nearest existing parent "
                                            f"{tmp_path}) (Permission denied); choose a writable folder\n")
    assert sorted(os.listdir(tmp_path)) == sorted([*gpu_check.FILES, "notes.txt"])
