"""A family added from the test tree alone (tests/fake_family.py) trains through the one entry
script at PP2 x DP2 with the losses of one process, and the planner plans it. It runs the
family's MLA variant (core's multi-head latent attention; its GQA attention trains at these
layouts in the other families' runs)."""
from __future__ import annotations

import subprocess
import sys

from tests.e2e.test_training import ROOT, train

FAKE = ["--model-module", "tests.fake_family", "--model-preset", "fake-mla-tiny", "--optimizer", "adamw",
        "--lr", "3e-3"]


def test_a_family_from_the_test_tree_trains_at_pp2_dp2_like_one_process(dataset, tmp_path):
    args = FAKE + ["--data-path", dataset, "--train-iters", "4"]
    one = train(args, tmp_path / "one")
    four = train(args + ["--pipeline-model-parallel-size", "2"], tmp_path / "four", world=4)
    assert len(one) == len(four) == 4 and one[-1]["loss"] < one[0]["loss"]
    for a, b in zip(one, four):  # the layouts' fp32 summation orders (tests/distributed): 1e-5
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    planned = subprocess.run([sys.executable, "tools/plan_memory.py", "--world-size", "4", *FAKE,
                              "--pipeline-model-parallel-size", "2", "--seq-length", "128"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0 and "fits" in planned.stdout, planned.stderr
