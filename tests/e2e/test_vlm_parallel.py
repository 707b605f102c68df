"""Image + text training through the command lines on the shared image + text dataset
(``shapes_data``, tests/e2e/conftest.py: PIL-drawn rows preprocessed with
``--tokenizer-type huggingface --tokenizer-model tests/fixtures/step3p7_processor``), trained by
``pretrain_step37.py --model-preset step37-tiny-vlm`` (whose vocabulary and ``<im_patch>`` id are
that processor folder's): PP2 x CP2 x EP2 (the images decoded and encoded on the first stage
only, by both its CP ranks, each writing its shard's features; EP2 over the CP ranks) logs the
losses of one process over 3 steps, and a run resumed from its step-2 checkpoint logs step 3's
loss and grad norm bit for bit: the one-process run builds its micro-batches on the training
thread (``--num-workers 0``), the others in two worker processes (the default). Documents are
padded to 4 in every run (what CP2 pads to), so one process plans the same packs. (CP2 with
FSDP and an image cut by the CP chunk boundary: tests/distributed/test_vlm_cp.py.)"""
from __future__ import annotations

import shutil

import pytest

from tests.e2e.conftest import PROCESSOR
from tests.e2e.test_training import train

VLM = ["--model-preset", "step37-tiny-vlm", "--tokenizer-type", "huggingface", "--tokenizer-model", PROCESSOR,
       "--optimizer", "adamw", "--lr", "1e-3", "--train-iters", "3",  # seq 128: every document fits
       "--document-pad-multiple", "4"]  # CP2's padding: one process plans the same packs


@pytest.fixture(scope="module")
def one_process(shapes_data, tmp_path_factory):
    """Three steps in one process, saved at step 2: (args, rows, checkpoint directory)."""
    d = tmp_path_factory.mktemp("vlm_one")
    args = ["--data-path", shapes_data, *VLM]
    # on the training thread; the other runs build micro-batches in 2 workers (the default)
    rows = train(args + ["--num-workers", "0", "--save", str(d / "ck"), "--save-interval", "2"], d / "log")
    assert len(rows) == 3
    return args, rows, d / "ck"


def test_vlm_pp2_cp2_ep2_logs_the_losses_of_one_process(one_process, tmp_path):
    """Four ranks: two pipeline stages, each of two CP ranks that are also the two EP ranks."""
    args, one, _ = one_process
    rows = train(args + ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
                         "--expert-model-parallel-size", "2"], tmp_path / "log", world=4)
    assert len(rows) == 3
    for a, b in zip(one, rows):
        # fp32, the same terms summed in another order (each CP rank sums its shard, attention
        # over its keys; as the text model's CP2 test); measured within 3.3e-8 relative
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])


def test_vlm_resume_is_bitwise(one_process, tmp_path):
    args, one, ck = one_process
    shutil.copytree(ck, tmp_path / "ck")
    (tmp_path / "ck" / "latest").write_text("iter_0000002")
    resumed = train(args + ["--load", str(tmp_path / "ck")], tmp_path / "resumed")
    assert [r["iteration"] for r in resumed] == [3]
    assert resumed[0]["loss"] == one[2]["loss"] and resumed[0]["grad_norm"] == one[2]["grad_norm"]  # exactly
