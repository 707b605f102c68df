"""A run's exit status and logs say what it trained: steps without targets or with non-finite
losses are not training, a resume onto other data is a clear error (a changed micro-batch size
is not a change of data), --train-iters below the checkpoint is an error, and metrics.jsonl
holds each iteration once after a resume into the same --log-dir.

The runs are in-process calls of ``pretrain_step37.main`` (0.3-0.7 s each, against about 3.5 s
for a new interpreter): the SIGTERM handler the trainer installs, the RNG state and the process
group are put back after each."""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
import torch.distributed as dist

COMMON = ["--model-preset", "tiny", "--seq-length", "128", "--global-batch-size", "4",
          "--log-interval", "1", "--seed", "7", "--optimizer", "adamw", "--lr", "1e-3"]


def run(args: list[str]) -> int:
    import pretrain_step37

    handler, rng = signal.getsignal(signal.SIGTERM), torch.get_rng_state()
    try:
        return pretrain_step37.main(COMMON + args)
    finally:
        signal.signal(signal.SIGTERM, handler)
        torch.set_rng_state(rng)
        if dist.is_initialized():
            dist.destroy_process_group()


def rows(log_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def run4(dataset, tmp_path_factory):
    """4 iterations, checkpoints at 2 and 4, metrics of every iteration."""
    d = tmp_path_factory.mktemp("run4")
    assert run(["--data-path", dataset, "--train-iters", "4", "--save", str(d / "ck"),
                "--save-interval", "2", "--log-dir", str(d / "log")]) == 0
    return d, rows(d / "log")


def test_steps_without_targets_fail_with_exit_1(dataset, capsys):
    """--seq-length 1: no pack holds a label. It reported 'final loss 0.0000', exit 0; now each
    step is skipped (no update: weight decay would still move the weights) and the run fails."""
    assert run(["--data-path", dataset, "--train-iters", "3", "--seq-length", "1"]) == 1
    err = capsys.readouterr().err
    assert "iteration 1: no training targets (--seq-length 1: a pack of one token has no label)" in err
    assert "every step of this run was skipped (3" in err and "nothing was trained" in err


def test_a_run_whose_every_step_is_non_finite_exits_1(dataset, tmp_path, capsys):
    """A NaN in the initial weights: every step skipped, fewer than --max-skipped-steps (10), so
    the run used to finish with exit 0."""
    from safetensors.torch import load_file, save_file

    from models.step37 import Step37Config, Step37Model

    Step37Model(Step37Config.preset("tiny"), seed=5).save_hf(str(tmp_path / "hf"))
    path = str(tmp_path / "hf" / "model.safetensors")
    weights = load_file(path)
    weights["layers.0.input_layernorm.weight"][0] = float("nan")
    save_file(weights, path, metadata={"format": "pt"})
    assert run(["--data-path", dataset, "--train-iters", "3", "--load-hf", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "every step of this run was skipped (3, the last for a non-finite loss" in err


def test_resuming_into_the_same_log_dir_logs_each_iteration_once(dataset, run4, tmp_path, capsys):
    """Interrupted after iteration 4 with its last checkpoint at 2: the resumed run logs 3 and 4
    again. They are logged once (the resumed values, bitwise the first run's), and the first
    run's rows past the checkpoint are kept aside, not lost."""
    d, full = run4
    shutil.copytree(d / "log", tmp_path / "log")
    assert run(["--data-path", dataset, "--train-iters", "4", "--load", str(d / "ck" / "iter_0000002"),
                "--log-dir", str(tmp_path / "log")]) == 0
    assert "2 row(s) past iteration 2" in capsys.readouterr().out
    now = rows(tmp_path / "log")
    assert [r["iteration"] for r in now] == [1, 2, 3, 4]
    assert [r["loss"] for r in now] == [r["loss"] for r in full]
    superseded = [json.loads(line) for line in open(tmp_path / "log" / "metrics.superseded.jsonl")]
    assert [r["iteration"] for r in superseded] == [3, 4]


def test_train_iters_below_the_checkpoint_is_an_error_and_equal_is_a_no_op(dataset, run4, capsys):
    """Both exited 0 with 'final loss nan'."""
    d, _ = run4
    assert run(["--data-path", dataset, "--train-iters", "3", "--load", str(d / "ck")]) == 1
    assert "is at iteration 4, past --train-iters 3: nothing to train" in capsys.readouterr().err
    assert run(["--data-path", dataset, "--train-iters", "4", "--load", str(d / "ck")]) == 0
    out = capsys.readouterr().out
    assert "at iteration 4 = --train-iters 4: nothing to train" in out and "loss nan" not in out


def test_a_data_change_on_resume_is_a_clear_error_unless_overridden(dataset, run4, capsys):
    """It was a ValueError traceback after 'resumed from ...'."""
    d, _ = run4
    args = ["--data-path", dataset, "--train-iters", "3", "--seq-length", "64",
            "--load", str(d / "ck" / "iter_0000002")]
    assert run(args) == 1
    cap = capsys.readouterr()
    assert "ERROR: --load " in cap.err and "the data differs from the checkpoint's: --seq-length 128 -> 64" in cap.err
    assert "--ignore-data-fingerprint" in cap.err and "resumed from" not in cap.out
    assert run(args + ["--ignore-data-fingerprint"]) == 0
    cap = capsys.readouterr()
    assert "--ignore-data-fingerprint: resuming on other data: --seq-length 128 -> 64" in cap.err
    assert "resumed from" in cap.out


def test_micro_batch_size_may_change_on_resume(dataset, run4, tmp_path):
    """docs/checkpoints.md: batch flags may change on a resume. The same packs per iteration,
    grouped 2 per micro-batch: the uninterrupted losses (1e-6 relative: the micro-batches sum
    their gradients in another order). It was refused, as a traceback."""
    d, full = run4
    assert run(["--data-path", dataset, "--train-iters", "4", "--micro-batch-size", "2",
                "--load", str(d / "ck" / "iter_0000002"), "--log-dir", str(tmp_path / "log")]) == 0
    resumed = rows(tmp_path / "log")
    assert [r["iteration"] for r in resumed] == [3, 4]
    for a, b in zip(full[2:], resumed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * a["loss"], (a["loss"], b["loss"])
