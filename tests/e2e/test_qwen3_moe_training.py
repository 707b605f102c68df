"""The second family through the one entry script: qwen3-moe-tiny (with its load-balancing loss,
router_aux_loss_coef 0.001) trains at PP2 x EP2 with the losses of one process, evaluates,
resumes bitwise, and its checkpoint refuses another family."""
from __future__ import annotations

import shutil

from tests.e2e.test_run_control import launch, training_rows, valid_rows
from tests.e2e.test_training import train

QWEN = ["--model-preset", "qwen3-moe-tiny", "--optimizer", "adamw", "--lr", "3e-3", "--train-iters", "6",
        "--split", "90,10,0", "--eval-interval", "3", "--eval-iters", "1"]


def test_qwen3_moe_pp2_ep2_matches_one_process_evaluates_and_resumes_bitwise(dataset, tmp_path):
    args = QWEN + ["--data-path", dataset]
    one = train(args + ["--save", str(tmp_path / "ck"), "--save-interval", "3"], tmp_path / "one")
    four = train(args + ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"],
                 tmp_path / "four", world=4)
    a, b = training_rows(one), training_rows(four)
    assert len(a) == len(b) == 6 and a[-1]["loss"] < a[0]["loss"]
    for x, y in zip(a, b):  # the layouts' fp32 summation orders (tests/distributed): 1e-5
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["loss"], y["loss"])
    va, vb = valid_rows(one), valid_rows(four)
    assert len(va) == len(vb) == 2 and abs(va[-1]["valid_loss"] - vb[-1]["valid_loss"]) <= 1e-5 * va[-1]["valid_loss"]

    shutil.rmtree(tmp_path / "ck" / "iter_0000006")
    (tmp_path / "ck" / "latest").write_text("iter_0000003")
    resumed = train(args + ["--load", str(tmp_path / "ck")], tmp_path / "resumed")
    assert [r["loss"] for r in training_rows(resumed)] == [r["loss"] for r in a[3:]]

    refused = launch(["--data-path", dataset, "--load", str(tmp_path / "ck"), "--train-iters", "4"],
                     tmp_path / "step")[0]
    assert refused.returncode == 1 and "a qwen3_moe checkpoint; this run trains a step37 model" in refused.stderr
