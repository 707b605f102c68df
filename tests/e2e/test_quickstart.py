"""A new user's path: the quickstart script and the inspector, as subprocesses (each tool once
as a script; its further cases call its ``main`` in this process: an interpreter costs ~2.5 CPU-s
of imports)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from data.indexed_dataset import IndexedDataset

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def in_process(main, capfd, *argv) -> tuple[int, str, str]:
    """A tool's ``main(argv)`` here: (exit code, stdout, stderr), as its script would give them."""
    try:
        rc = main(list(map(str, argv)))
    except SystemExit as e:  # argparse's errors
        rc = e.code
    out = capfd.readouterr()
    return rc, out.out, out.err


def test_quickstart_trains_on_real_text_and_shows_its_loss_and_samples(tmp_path):
    """The quickstart as a new user runs it (10 iterations instead of 300 to keep CI short): a BPE
    tokenizer trained on the shipped corpus, the corpus tokenized with it, training with a
    held-out validation part, the loss curve in TensorBoard and as a PNG beside it, the validation
    loss against the corpus's unigram entropy, and lines sampled from the checkpoint."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    from tests.e2e.test_training import free_port

    env["MASTER_PORT"] = str(free_port())
    env["PYTHON"] = sys.executable  # as `make quickstart` passes the interpreter it installed into
    out = subprocess.run(["bash", "examples/quickstart.sh", str(tmp_path), "10"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "train_tokenizer: byte-level BPE, 1,024 entries" in out.stdout
    assert "rows read 2,188, accepted 2,188" in out.stdout
    assert "inspect_packs:" in out.stdout and "TensorBoard logs in" in out.stdout
    assert "pretrain_step37: 10 iterations (0 skipped)" in out.stdout
    tb = tmp_path / "tensorboard"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [10]  # the loss curve, in TensorBoard
    assert [e.step for e in events.Scalars("valid/loss")] == [10]
    rows = [json.loads(l) for l in (tb / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [10, 10] and rows[0]["loss"] > 0  # training, validation
    assert (tb / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    from data.unigram import unigram_entropy

    entropy, _ = unigram_entropy(str(tmp_path / "data" / "pydoc_text_document"), 0, int(2188 * 0.95))
    seen = re.search(r"plot_loss: validation loss ([\d.]+) nats/token at iteration 10, (NOT )?below the "
                     r"unigram entropy of the training data ([\d.]+) nats/token", out.stdout)
    assert seen and float(seen.group(1)) == pytest.approx(rows[1]["valid_loss"], abs=5e-4)
    assert float(seen.group(3)) == pytest.approx(entropy, abs=5e-4) and 5.5 < entropy < 6.5
    assert re.search(r"^\[greedy\] 'The' -> '.+'$", out.stdout, re.M)  # the model speaks
    assert re.search(r"^\[ T=0.8\] 'Return the' -> '.+'$", out.stdout, re.M)
    text = IndexedDataset(tmp_path / "data" / "sample_chat_text_document")
    mask = IndexedDataset(tmp_path / "data" / "sample_chat_loss_mask_document")
    assert len(text) == 1000 and (text.lengths == mask.lengths).all()


def test_inspect_packs_cli(tmp_path, capfd):
    from tools.inspect_packs import main

    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input",
                    "examples/data/sample_text.jsonl", "--output-prefix", str(tmp_path / "s")],
                   cwd=ROOT, check=True, capture_output=True)
    out = subprocess.run([sys.executable, "tools/inspect_packs.py", "--data-path",
                          str(tmp_path / "s_text_document"), "--seq-length", "1024",
                          "--long-docs", "truncate"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--long-docs truncate" in out.stdout and "tokens lost" in out.stdout and "cp padding" not in out.stdout
    rc, cp, err = in_process(main, capfd, "--data-path", tmp_path / "s_text_document", "--seq-length", "1024",
                             "--long-docs", "truncate", "--context-parallel-size", "4")
    assert rc == 0, err
    assert "cp padding   documents padded to a multiple of 8: +" in cp, cp
    rc, _, err = in_process(main, capfd, "--data-path", tmp_path / "s_text_document", "--seq-length", "1020",
                            "--context-parallel-size", "4")
    assert rc == 2 and "--seq-length 1020 must be a multiple of the document pad multiple 8" in err
    rc, _, err = in_process(main, capfd, "--data-path", tmp_path / "nope", "--seq-length", "8")
    assert rc == 1 and "nope.idx: no such file" in err


def test_convert_checkpoint_check(tmp_path, capfd):
    from tests.unit.hf_reference import save_full_model
    from tools.convert_checkpoint import main

    save_full_model(str(tmp_path), seed=0)
    ok = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "check", str(tmp_path)],
                        cwd=ROOT, capture_output=True, text=True)
    # transformers does not save MTP depths: the tiny config has 2, so they are reported missing
    assert ok.returncode == 1 and "model.layers.4.enorm.weight (mtp.0.enorm.weight)" in ok.stdout
    assert "0 unexpected, 0 mis-shaped" in ok.stdout
    rc, flash, _ = in_process(main, capfd, "check", tmp_path, "--model-preset", "step37-flash")
    assert rc == 1 and "196,956,118,272 without MTP" in flash
    assert "model.embed_tokens.weight: checkpoint [320, 64], model [128896, 4096]" in flash


def test_pipeline_sim_cli(tmp_path, capfd):
    from tools.pipeline_sim import main

    out = subprocess.run([sys.executable, "tools/pipeline_sim.py", "--pp", "8", "--vpp", "3",
                          "--microbatches", "32", "--plot", str(tmp_path / "s.png")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "no deadlock, NCCL-safe, bubble 6.80%" in out.stdout and (tmp_path / "s.png").stat().st_size > 0
    rc, model, err = in_process(main, capfd, "--pp", "4", "--microbatches", "32", "--model-preset", "step37-flash",
                                "--seq-length", "8192")
    assert rc == 0, err
    assert "default layout 14,14,14,3: slowest stage 7.61 vs 11.93 GFLOP/token (even 11,12,11,11)" in model
    rc, _, err = in_process(main, capfd, "--pp", "4", "--vpp", "2", "--microbatches", "6")
    assert rc == 1 and "multiple of --pipeline-model-parallel-size" in err


def test_dry_run_and_plan_memory_for_the_full_model(capfd):
    from tools.plan_memory import main

    out = subprocess.run([sys.executable, "pretrain_step37.py", "--model-preset", "step37-flash",
                          "--dry-run", "8", "--pipeline-model-parallel-size", "4",
                          "--expert-model-parallel-size", "2", "--data-path", "unused",
                          "--seq-length", "8192", "--global-batch-size", "64", "--optimizer", "muon",
                          "--muon-momentum", "0", "--recompute-granularity", "full",
                          "--bf16", "--pipeline-layout", "11,12,11,11"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "32 micro-batches per pipeline; nothing allocated" in out.stdout
    assert out.stdout.count("\npp") == 8 + 4 and "does NOT fit 141 GB" in out.stdout  # memory, time rows
    assert "tokens/s per GPU" in out.stdout
    rc, js, err = in_process(main, capfd, "--world-size", "8", "--model-preset", "step37-flash",
                             "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "2",
                             "--seq-length", "8192", "--global-batch-size", "64", "--optimizer", "muon",
                             "--muon-momentum", "0", "--bf16", "--recompute-granularity", "full",
                             "--data-parallel-sharding", "fsdp", "--cpu-offload", "optimizer", "--json")
    assert rc == 0, err
    ranks = json.loads(js)["ranks"]
    assert len(ranks) == 8 and all(r["fits"] for r in ranks) and all(r["host_total"] > 0 for r in ranks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs tools/gpu_check.sh itself")
def test_gpu_check_says_it_needs_a_gpu_here():
    out = subprocess.run(["bash", "tools/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "gpu_check: needs a CUDA GPU" in out.stderr
