"""``--load`` of our checkpoint never reads the ``--load-hf`` checkpoint: a run started from HF
weights resumes bitwise with the HF weight files gone (only its config.json, the model's shape,
is still read)."""
from __future__ import annotations

import os
import shutil

from models.step37 import Step37Config, Step37Model
from tests.e2e.test_training import train


def test_resume_from_our_checkpoint_never_reads_the_hf_checkpoint(dataset, tmp_path):
    hf = tmp_path / "hf"
    Step37Model(Step37Config.preset("tiny"), seed=5).save_hf(str(hf))
    args = ["--data-path", dataset, "--load-hf", str(hf), "--optimizer", "adamw", "--lr", "1e-3",
            "--train-iters", "4", "--save", str(tmp_path / "ck"), "--save-interval", "2"]
    full = train(args, tmp_path / "a")
    # interrupted after iteration 2; the HF weights are gone (a deleted or unreachable directory)
    shutil.rmtree(tmp_path / "ck" / "iter_0000004")
    (tmp_path / "ck" / "latest").write_text("iter_0000002")
    weights = [f for f in os.listdir(hf) if f.endswith(".safetensors")]
    assert weights
    for f in weights:
        os.remove(hf / f)
    resumed = train(args + ["--load", str(tmp_path / "ck")], tmp_path / "b")
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]  # exactly
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[2:]]
