#!/usr/bin/env python3
"""The blind baseline of a preprocessed make_shapes_vlm dataset, per target token: the loss a
model that cannot see the images would reach at best.

    python examples/data/shapes_vlm_baseline.py DATA_PREFIX TOKENIZER_DIR [--split 90,10,0]

Why this number: every answer is fixed text around a few unknowns (shape, colour, digit, and for
"What is in the picture?" whether there is a digit), drawn uniformly and independently of the
question, which the model sees. A model without the image can at best learn the fixed text
exactly (0 nats) and guess each unknown from its prior, so its expected loss over a document is
the entropy of the unknowns given the question (``make_shapes_vlm.BLIND``), and over a set of
documents the sum of those entropies divided by the number of target tokens (the loss mask's
1s: the answer's tokens and the end-of-turn token), which is what the trainer averages over. A
loss below it on held-out documents can only come from reading the pictures (the text part of a
document says nothing about them). The answer kind of each document is read from its decoded
targets, so the count holds for whichever documents preprocessing kept.

Prints one line per part of ``--split`` that has documents (train, valid).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from make_shapes_vlm import BLIND, SHAPES  # noqa: E402


def answer_kind(text: str) -> str:
    """Which question an answer answers (the answer forms of make_shapes_vlm)."""
    if text.startswith("The digit "):
        return "digit"
    if text.startswith("It is "):
        return "colour"
    if any(text.startswith(f"A {s}.") for s in SHAPES):
        return "shape"
    if text.startswith("A "):
        return "all"
    raise ValueError(f"not a make_shapes_vlm answer: {text!r}")


def per_document(prefix: str, tokenizer_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """(blind nats, target tokens) of every document of the dataset."""
    from data.indexed_dataset import IndexedDataset
    from data.tokenizers import build_tokenizer

    tok = build_tokenizer("huggingface", tokenizer_dir)
    text = IndexedDataset(prefix)
    mask = IndexedDataset(prefix.replace("_text_document", "_loss_mask_document"))
    nats, targets = np.zeros(len(text)), np.zeros(len(text), np.int64)
    for d in range(len(text)):
        ids, m = np.asarray(text.get(d)), np.array(mask.get(d))
        m[0] = 0  # the first token is nobody's label
        nats[d] = BLIND[answer_kind(tok.decode(ids[m == 1].tolist()))]
        targets[d] = int(m.sum())
    return nats, targets


def main(argv: list[str] | None = None) -> int:
    from data.splits import split_bounds

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data_prefix", help="PREFIX_text_document of a make_shapes_vlm dataset")
    ap.add_argument("tokenizer_dir", help="the tokenizer it was preprocessed with")
    ap.add_argument("--split", default="100,0,0", help="as the trainer's --split")
    ap.add_argument("--log", help="a pretrain_step37.py log: compare the mean of its last five logged "
                                  "training losses, and its last validation loss, with the baselines")
    args = ap.parse_args(argv)
    nats, targets = per_document(args.data_prefix, args.tokenizer_dir)
    train_end, valid_end = split_bounds(len(nats), args.split)
    losses = last_losses(args.log) if args.log else {}
    for name, lo, hi in (("train", 0, train_end), ("valid", train_end, valid_end)):
        if hi > lo:
            t = int(targets[lo:hi].sum())
            base = nats[lo:hi].sum() / t
            print(f"blind baseline ({name}: documents {lo}..{hi - 1}, {t} target tokens): "
                  f"{base:.4f} nats per target token ({nats[lo:hi].mean():.3f} per answer)")
            if losses.get(name):
                # one step's training loss is noisy: the mean of the last five logged; the
                # validation loss is over the same held-out batches every time: the last
                seen = losses[name][-5:] if name == "train" else losses[name][-1:]
                loss = sum(v for _, v in seen) / len(seen)
                verdict = "below: the model reads the images" if loss < base else "NOT below the baseline"
                its = f"iteration {seen[0][0]}" if len(seen) == 1 else f"iterations {seen[0][0]}-{seen[-1][0]} (mean of {len(seen)})"
                last = f", last {seen[-1][1]:.4f}" if len(seen) > 1 else ""
                print(f"  {name} loss at {its}: {loss:.4f}{last} ({verdict})")
    return 0


def last_losses(log: str) -> dict:
    """{"train": [(iteration, lm loss), ...], "valid": [...]}: every one logged, in order."""
    import re

    out = {"train": [], "valid": []}
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = re.search(r"iteration +(\d+)/\d+ +\| lm loss: ([0-9.eE+-]+)", line)
            if m:
                out["train"].append((int(m.group(1)), float(m.group(2))))
            m = re.search(r"validation loss at iteration (\d+) \| lm loss: ([0-9.eE+-]+)", line)
            if m:
                out["valid"].append((int(m.group(1)), float(m.group(2))))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
