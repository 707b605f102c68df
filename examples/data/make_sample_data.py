#!/usr/bin/env python3
"""Writes the shipped sample data: sample_text.jsonl and sample_chat.jsonl (deterministic).

The text is synthetic (a small grammar over a fixed word list, seeded), so it can be shipped
and regenerated without downloads. It deliberately includes non-ASCII text and a few rows whose
strings hold U+2028 / U+2029 / CR, which a reader that splits on str.splitlines() would break.

    python examples/data/make_sample_data.py [--out-dir examples/data] [--rows 3000]
"""
from __future__ import annotations

import argparse
import json
import os
import random

SUBJECTS = ["the model", "a pipeline stage", "the router", "each expert", "the optimizer",
            "our loader", "the tokenizer", "a packed row", "the scheduler", "every rank",
            "the attention layer", "a gradient bucket", "the checkpoint", "this document"]
VERBS = ["computes", "sends", "receives", "normalises", "packs", "splits", "reads", "writes",
         "updates", "shards", "gathers", "reduces", "checks", "skips", "rotates", "masks"]
OBJECTS = ["the hidden states", "a micro-batch", "its gradients", "the loss", "every token",
           "the position ids", "the sequence lengths", "a shared expert", "the learning rate",
           "the attention scores", "a sliding window", "the vocabulary", "the bias term"]
TAILS = ["before the next step", "in fp32", "across data-parallel ranks", "without padding",
         "once per iteration", "on the last stage", "for every document", "with a fixed seed",
         "when the window is full", "after the warmup", "in a single pass", ""]
EXTRAS = ["Déjà vu: naïve café.", "数据并行与流水线并行。", "Ünïcödé ✓ 🚀", "λ = 0.95, μ = 0"]
QUESTIONS = ["What does {s} do?", "Why does {s} matter?", "How often does {s} run?",
             "Explain {s} briefly.", "Can {s} fail?"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}"
    return s.strip().capitalize() + "."


def paragraph(rng: random.Random, n_sentences: int) -> str:
    parts = [sentence(rng) for _ in range(n_sentences)]
    if rng.random() < 0.05:
        parts.insert(rng.randrange(len(parts) + 1), rng.choice(EXTRAS))
    return " ".join(parts)


def text_row(rng: random.Random, i: int) -> dict:
    n = max(1, min(120, int(rng.lognormvariate(2.0, 0.9))))
    text = paragraph(rng, n)
    if i % 500 == 7:  # separators that str.splitlines() would split on
        text = text.replace(". ", ".\u2028", 1).replace(". ", ".\u2029", 1).replace(". ", ".\r", 1)
    return {"text": text, "id": i}


def chat_row(rng: random.Random, i: int) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a concise assistant for ML engineers."})
    for turn in range(rng.randint(1, 3)):
        topic = rng.choice(SUBJECTS)
        messages.append({"role": "user", "content": rng.choice(QUESTIONS).format(s=topic)})
        if rng.random() < 0.15:
            messages.append({"role": "assistant", "content": f"Let me look up {topic}."})
            messages.append({"role": "tool", "content": paragraph(rng, 1)})
        messages.append({"role": "assistant", "content": paragraph(rng, rng.randint(1, 6))})
    return {"messages": messages, "id": i}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--rows", type=int, default=3000, help="text rows (chat rows: a third)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    paths = {"sample_text.jsonl": [text_row(rng, i) for i in range(args.rows)],
             "sample_chat.jsonl": [chat_row(rng, i) for i in range(args.rows // 3)]}
    for name, rows in paths.items():
        path = os.path.join(args.out_dir, name)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
