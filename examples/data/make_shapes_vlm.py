#!/usr/bin/env python3
"""A small image + text chat dataset drawn with PIL, no downloads: shapes in colours, some with a
digit, each with a question and its answer.

    python examples/data/make_shapes_vlm.py OUT_DIR [--rows 400] [--seed 0]

writes ``OUT_DIR/images/*.png`` and ``OUT_DIR/rows.jsonl``, one chat row per line, the user turn a
list of parts (the image by a path relative to the file, then the question) as transformers'
processors take them::

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "images/00000.png"},
                                               {"type": "text", "text": "What is in the picture?"}]},
                  {"role": "assistant", "content": "A red circle."}]}

Images vary in size and aspect ratio (so their placeholder runs, and the documents' lengths, vary).
The answers name what the image shows and nothing the question gives away, so a model that does
not look at the image cannot do better than guess among the colours, shapes and digits: the
``blind baseline`` printed at the end (nats per answer, spread over its tokens by the trainer) is
what the loss must fall below to show the model reads the pictures.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTIONS = {
    "all": "What is in the picture?",
    "shape": "Which shape is drawn?",
    "colour": "What colour is the shape?",
    "digit": "Which digit is written on the shape?",
}

# what a model that cannot see does best, in nats per answer: guess each unknown among its equally
# likely values (digit presence is part of "all": 1/2 with, 1/2 without)
BLIND = {"all": math.log(len(SHAPES)) + math.log(len(COLOURS)) + math.log(2) + 0.5 * math.log(10),
         "shape": math.log(len(SHAPES)), "colour": math.log(len(COLOURS)), "digit": math.log(10)}


def draw(shape: str, colour: str, digit: int | None, width: int, height: int, rng: random.Random):
    """One picture: a light background, the shape in ``colour`` filling about half of the short
    side at a random place, the digit in black at its centre when given."""
    from PIL import Image, ImageDraw

    bg = tuple(rng.randint(225, 255) for _ in range(3))
    img = Image.new("RGB", (width, height), bg)
    d = ImageDraw.Draw(img)
    side = max(8, int(min(width, height) * rng.uniform(0.45, 0.7)))
    x0, y0 = rng.randint(0, width - side), rng.randint(0, height - side)
    box = (x0, y0, x0 + side, y0 + side)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:
        d.polygon([(x0 + side / 2, y0), (x0, y0 + side), (x0 + side, y0 + side)], fill=fill)
    if digit is not None:
        d.text((x0 + side / 2, y0 + side * (0.62 if shape == "triangle" else 0.5)), str(digit), fill=(0, 0, 0),
               anchor="mm", font_size=max(8, side // 3))
    return img


def make_rows(out_dir: str, rows: int, seed: int) -> dict:
    """Write the images and rows; returns counts and the blind baseline."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    kinds = {k: 0 for k in QUESTIONS}
    with open(os.path.join(out_dir, "rows.jsonl"), "w", encoding="utf-8") as f:
        for i in range(rows):
            shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
            digit = rng.randint(0, 9) if rng.random() < 0.5 else None
            kind = rng.choice(["all", "shape", "colour"] + (["digit"] if digit is not None else []))
            # sizes from small to a few hundred pixels, square to 3:1 either way
            short = rng.randint(48, 220)
            ratio = rng.choice([1.0, 1.0, 1.5, 2.0, 3.0])
            w, h = (int(short * ratio), short) if rng.random() < 0.5 else (short, int(short * ratio))
            name = f"images/{i:05d}.png"
            draw(shape, colour, digit, w, h, rng).save(os.path.join(out_dir, name))
            answer = {"all": f"A {colour} {shape}" + (f" with the digit {digit}." if digit is not None else "."),
                      "shape": f"A {shape}.", "colour": f"It is {colour}.", "digit": f"The digit {digit}."}[kind]
            row = {"messages": [
                {"role": "user", "content": [{"type": "image", "path": name}, {"type": "text", "text": QUESTIONS[kind]}]},
                {"role": "assistant", "content": answer}]}
            f.write(json.dumps(row) + "\n")
            kinds[kind] += 1
    nats = sum(BLIND[k] * n for k, n in kinds.items()) / max(rows, 1)
    return {"rows": rows, "kinds": kinds, "blind_nats_per_answer": nats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--rows", type=int, default=400, help="chat rows (one image each)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rows < 1:
        ap.error("--rows must be >= 1")
    info = make_rows(args.out_dir, args.rows, args.seed)
    print(f"make_shapes_vlm: {info['rows']} rows with one image each in {args.out_dir}/rows.jsonl "
          f"({', '.join(f'{k} {n}' for k, n in info['kinds'].items())}); blind baseline "
          f"{info['blind_nats_per_answer']:.3f} nats per answer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
