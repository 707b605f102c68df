"""What Megatron users expect of a run, end to end on CPU: evaluation that changes no training
loss, exits that save and resume onto the same schedule, fine-tuning loads, a resume with
another model refused, and a frozen rank that ends the run within --distributed-timeout-minutes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.e2e.test_training import COMMON, ROOT, free_port, train

ADAMW = ["--optimizer", "adamw", "--lr", "1e-3"]
MUON = ["--optimizer", "muon", "--muon-momentum", "0.9", "--lr", "0.02"]


def launch(args: list[str], log_dir) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """One process, whatever its exit status: (the process, its metrics.jsonl rows)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "pretrain_step37.py"] + COMMON + args + ["--log-dir", str(log_dir)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    path = os.path.join(str(log_dir), "metrics.jsonl")
    return out, [json.loads(l) for l in open(path)] if os.path.exists(path) else []


def training_rows(rows):
    return [r for r in rows if "loss" in r]


def valid_rows(rows):
    return [r for r in rows if "valid_loss" in r]


def test_evaluation_logs_validation_loss_and_changes_no_training_loss(dataset, tmp_path):
    """Validation every 2 iterations and at the end, on the held-out tenth of the documents;
    the training losses are bitwise those of a run without evaluation (its own loader, no
    gradient, RNG restored), and PP2 logs the same validation losses (1e-5 relative: other
    summation order). Every layout's forward-only pass: tests/distributed/test_eval_layouts.py."""
    args = ["--data-path", dataset, *ADAMW, "--train-iters", "5", "--split", "90,10,0"]
    plain = train(args + ["--eval-iters", "0"], tmp_path / "plain")
    evald = train(args + ["--eval-interval", "2", "--eval-iters", "2"], tmp_path / "eval")
    assert [r["loss"] for r in training_rows(evald)] == [r["loss"] for r in plain]
    valid = valid_rows(evald)
    assert [r["iteration"] for r in valid] == [2, 4, 5]  # every 2, and the final one
    assert all(r["valid_loss"] > 0 and abs(r["valid_ppl"] - 2.718281828 ** r["valid_loss"]) < 1e-6 * r["valid_ppl"]
               for r in valid)
    assert valid[0]["valid_targets"] == valid[-1]["valid_targets"] > 0  # the same batches each time
    assert "valid_loss" not in training_rows(evald)[0] and "loss" not in valid[0]
    pp2 = valid_rows(train(args + ["--eval-interval", "2", "--eval-iters", "2",
                                   "--pipeline-model-parallel-size", "2"], tmp_path / "pp2", world=2))
    for a, b in zip(valid, pp2, strict=True):
        assert abs(a["valid_loss"] - b["valid_loss"]) <= 1e-5 * a["valid_loss"], (a, b)


def test_exit_interval_and_a_longer_run_resume_onto_the_same_schedule(dataset, muon8, tmp_path):
    """Stopped by --exit-interval 3 and resumed; trained 5 of a fixed 8-iteration schedule and
    resumed with --train-iters 8: both log bitwise the losses and learning rates of one
    uninterrupted run (Muon with momentum, so the optimizer state matters; the shared run of
    tests/e2e/conftest.py, these flags)."""
    from tests.e2e.conftest import MUON8

    assert MUON8 == [*MUON, "--lr-decay-iters", "8"]
    base = ["--data-path", dataset, *MUON8]
    full = muon8
    out, stopped = launch(base + ["--train-iters", "8", "--exit-interval", "3", "--save", str(tmp_path / "a")],
                          tmp_path / "stopped")
    assert out.returncode == 0 and "--exit-interval 3: saving and exiting at iteration 3" in out.stdout, out.stderr
    assert [r["iteration"] for r in stopped] == [1, 2, 3]
    resumed = train(base + ["--train-iters", "8", "--load", str(tmp_path / "a")], tmp_path / "resumed")
    train(base + ["--train-iters", "5", "--save", str(tmp_path / "b")], tmp_path / "short")
    extended = train(base + ["--train-iters", "8", "--load", str(tmp_path / "b")], tmp_path / "extended")
    for rows, start in ((resumed, 3), (extended, 5)):
        assert [r["iteration"] for r in rows] == list(range(start + 1, 9))
        assert [(r["loss"], r["lr"]) for r in rows] == [(r["loss"], r["lr"]) for r in full[start:]]
    assert full[-1]["lr"] < full[4]["lr"]  # the cosine decays over all 8 iterations


def test_async_save_publishes_complete_checkpoints_that_resume(dataset, tmp_path):
    """DP 2 with --async-save every 2 iterations: each checkpoint is written in the background and
    published before the next save (or the exit); the one of iteration 4 resumes in one process
    onto the same losses (1e-6 relative: DP 2 sums the gradients in another order)."""
    args = ["--data-path", dataset, *MUON, "--train-iters", "6"]
    full = train(args + ["--save", str(tmp_path / "ck"), "--save-interval", "2", "--async-save"],
                 tmp_path / "full", world=2, torchrun=True)  # the background save under torchrun
    assert sorted(os.listdir(tmp_path / "ck")) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]
    assert (tmp_path / "ck" / "latest").read_text() == "iter_0000006"
    resumed = train(args + ["--load", str(tmp_path / "ck" / "iter_0000004")], tmp_path / "resumed")
    assert [r["iteration"] for r in resumed] == [5, 6]
    for a, b in zip(full[4:], resumed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a["loss"], b["loss"])


def test_exit_duration_saves_and_exits_0(dataset, tmp_path):
    out, rows = launch(["--data-path", dataset, *ADAMW, "--train-iters", "50", "--exit-duration-in-mins",
                        "0.0001", "--save", str(tmp_path / "ck")], tmp_path / "tb")
    assert out.returncode == 0 and "--exit-duration-in-mins 0.0001 reached" in out.stdout, out.stderr
    assert [r["iteration"] for r in rows] == [1]
    assert (tmp_path / "ck" / "latest").read_text() == "iter_0000001"


def _three_layer_config(path) -> str:
    from models.step37 import Step37Config

    c = Step37Config.preset("tiny").to_hf()
    L, D = c["num_hidden_layers"], c["num_nextn_predict_layers"]
    c["num_hidden_layers"] = L - 1
    c["layer_types"], c["mlp_layer_types"] = c["layer_types"][:L - 1], c["mlp_layer_types"][:L - 1]
    for key in ("swiglu_limits", "swiglu_limits_shared"):  # L entries, then the MTP depths'
        c[key] = c[key][:L - 1] + c[key][L:L + D]
    c["per_layer_config"] = {k: v for k, v in c["per_layer_config"].items() if int(k) < L - 1}
    path.write_text(json.dumps(c))
    return str(path)


def test_loads_refuse_another_model_and_finetune_or_fresh_optimizer_on_request(dataset, tmp_path):
    """A resume with 3 layers from a 4-layer checkpoint is refused naming the field (it loaded
    silently before); --finetune takes the weights and starts at iteration 0; a resume under
    another optimizer needs --no-load-optim, and keeps the iteration."""
    args = ["--data-path", dataset, *ADAMW]
    train(args + ["--train-iters", "2", "--save", str(tmp_path / "ck")], tmp_path / "first")
    three = ["--hf-config", _three_layer_config(tmp_path / "three.json")]
    out, _ = launch(args + three + ["--train-iters", "4", "--load", str(tmp_path / "ck")], tmp_path / "refused")
    assert out.returncode == 1 and "num_layers: checkpoint 4, this run 3" in out.stderr, out.stderr
    tuned = train(args + three + ["--train-iters", "2", "--load", str(tmp_path / "ck"), "--finetune"],
                  tmp_path / "finetune")
    assert [r["iteration"] for r in tuned] == [1, 2]
    out, _ = launch(args[:2] + MUON + ["--train-iters", "4", "--load", str(tmp_path / "ck")], tmp_path / "opt")
    assert out.returncode == 1 and "--no-load-optim" in out.stderr, out.stderr
    fresh = train(args[:2] + MUON + ["--train-iters", "4", "--load", str(tmp_path / "ck"), "--no-load-optim"],
                  tmp_path / "fresh")
    assert [r["iteration"] for r in fresh] == [3, 4]


def _children(pid: int) -> dict[int, int]:
    """RANK -> pid of the processes torchrun ``pid`` started."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            out[int(env[b"RANK"])] = int(entry)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return out


def test_a_frozen_rank_ends_the_run_within_the_timeout(dataset, tmp_path):
    """DP 2; rank 1 is stopped (SIGSTOP) mid-run. Rank 0 ends within the 6 s timeout (plus a
    step) with a message naming --distributed-timeout-minutes; before, it waited the default
    30 minutes without a word."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    log = open(tmp_path / "out.txt", "w")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "pretrain_step37.py", *COMMON, "--data-path", dataset, *ADAMW,
           "--train-iters", "100000", "--distributed-timeout-minutes", "0.1", "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    ranks = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "metrics.jsonl").exists():
            time.sleep(0.2)
        ranks = _children(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 60 and os.path.exists(f"/proc/{ranks[0]}") and \
                open(f"/proc/{ranks[0]}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.2)
        took = time.monotonic() - stopped
    finally:
        for pid in ranks.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=120)
        log.close()
    text = (tmp_path / "out.txt").read_text()
    assert "[rank 0] ERROR: a collective or pipeline transfer failed" in text and \
        "--distributed-timeout-minutes 0.1" in text, text[-3000:]
    assert took < 30, took
    assert proc.returncode != 0
