"""examples/data/shapes_vlm_baseline.py: the blind baseline is the make_shapes_vlm entropy of each
document's answer divided by the targets the loss masks hold, counted from a real preprocessed
dataset (the answer tokens and the end of turn), and a trainer log is read as the trainer writes it."""
from __future__ import annotations

import json
import math
import os
import sys

ROOT = __file__.rsplit("/tests/", 1)[0]
sys.path.insert(0, os.path.join(ROOT, "examples", "data"))

from make_shapes_vlm import BLIND, make_rows  # noqa: E402
from shapes_vlm_baseline import answer_kind, last_losses, per_document  # noqa: E402

PROCESSOR = os.path.join(ROOT, "tests", "fixtures", "step3p7_processor")


def test_baseline_counts_the_answers_targets(tmp_path):
    from data.tokenizers import build_tokenizer
    from tools.preprocess_data import main as preprocess

    make_rows(str(tmp_path / "s"), 12, seed=3)
    assert preprocess(["--chat", "--tokenizer-type", "huggingface", "--tokenizer-model", PROCESSOR,
                       "--input", str(tmp_path / "s" / "rows.jsonl"), "--output-prefix", str(tmp_path / "d")]) == 0
    nats, targets = per_document(str(tmp_path / "d_text_document"), PROCESSOR)
    tok = build_tokenizer("huggingface", PROCESSOR)
    rows = [json.loads(line) for line in open(tmp_path / "s" / "rows.jsonl")]
    for r, n, t in zip(rows, nats, targets):
        answer = r["messages"][1]["content"]
        assert n == BLIND[answer_kind(answer)]
        assert t == len(tok.encode(answer)) + 1  # the answer and <|im_end|>
    assert answer_kind("A red circle.") == "all" and answer_kind("A circle.") == "shape"
    assert math.isclose(BLIND["all"], math.log(3 * 4 * 2) + 0.5 * math.log(10))


def test_last_losses_reads_the_trainer_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(" iteration     10/20     | lm loss: 0.5000 | mtp loss: 1\n"
                   " validation loss at iteration 10 | lm loss: 4.0E-01 | lm loss PPL: 1.5\n"
                   " iteration     20/20     | lm loss: 0.2500 | mtp loss: 1\n")
    assert last_losses(str(log)) == {"train": [(10, 0.5), (20, 0.25)], "valid": [(10, 0.4)]}
