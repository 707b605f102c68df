#!/usr/bin/env python3
"""Data wait per step with ``--num-workers 0, 1, 2``: the tiny VLM trained on photo-sized images
(issue 41, "Benchmark").

Rows: ``--rows`` chat rows, each a user turn of ``--images`` generated photos (``--width`` x
``--height`` JPEGs, quality 90: smooth colour fields with fine noise, ~0.2-0.4 MB each, which
decode like camera pictures rather than flat drawings) and a short question, and an answer.
Preprocessed once by ``tools/preprocess_data.py --chat`` with the tests' tiny Step-3.7 processor
(``tests/fixtures/step3p7_processor``: 112 px global views, 56 px crops): each image still has
to be read, checked (CRC-32), decoded at full size and resized by the loader, which is the cost
measured here; the tower then sees few tokens per image.

Each setting is one ``pretrain_step37.py`` run (``--model-preset step37-tiny-vlm``, fp32, one
process, ``OMP_NUM_THREADS=1``) of ``--iters`` steps of ``--global-batch-size`` packs of
``--seq-length`` tokens (micro-batch 1, so as many micro-batches per step); reported from its
``metrics.jsonl``: the mean ``data_wait_s`` and step time over the steps after the first (the
first includes the workers' start and their first micro-batches).

    python benchmarks/bench_loader.py [--rows 24] [--images 4] [--iters 6] [--workers 0 1 2]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSOR = os.path.join(ROOT, "tests", "fixtures", "step3p7_processor")
sys.path.insert(0, ROOT)  # run as a script: the repository's packages (tools, data, models)


def photo(rng: np.random.Generator, w: int, h: int) -> bytes:
    from PIL import Image

    coarse = Image.fromarray(rng.integers(0, 256, (h // 64 + 2, w // 64 + 2, 3), dtype=np.uint8))
    base = np.asarray(coarse.resize((w, h), Image.BICUBIC), dtype=np.int16)
    pixels = np.clip(base + rng.integers(-12, 13, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_dataset(d: str, rows: int, images: int, w: int, h: int) -> tuple[str, float]:
    """The rows' images and JSONL, preprocessed; returns the text prefix and the mean JPEG size."""
    from tools.preprocess_data import main as preprocess

    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(d, "images"), exist_ok=True)
    sizes = []
    with open(os.path.join(d, "rows.jsonl"), "w", encoding="utf-8") as f:
        for i in range(rows):
            parts = []
            for k in range(images):
                name = f"images/{i:04d}_{k}.jpg"
                data = photo(rng, w, h)
                sizes.append(len(data))
                with open(os.path.join(d, name), "wb") as out:
                    out.write(data)
                parts.append({"type": "image", "path": name})
            parts.append({"type": "text", "text": f"What do these {images} photos have in common? ({i})"})
            f.write(json.dumps({"messages": [{"role": "user", "content": parts},
                                             {"role": "assistant", "content": "Colours and noise."}]}) + "\n")
    prefix = os.path.join(d, "out", "photos")
    assert preprocess(["--input", os.path.join(d, "rows.jsonl"), "--output-prefix", prefix, "--chat",
                       "--tokenizer-type", "huggingface", "--tokenizer-model", PROCESSOR,
                       "--append-eod"]) == 0
    return prefix + "_text_document", sum(sizes) / len(sizes)


def command(prefix: str, workers, args, log_dir: str) -> list[str]:
    """The training command of one setting."""
    return ["pretrain_step37.py", "--model-preset", "step37-tiny-vlm",
            "--tokenizer-type", "huggingface", "--tokenizer-model", os.path.relpath(PROCESSOR, ROOT),
            "--data-path", prefix, "--seq-length", str(args.seq_length),
            "--global-batch-size", str(args.global_batch_size), "--micro-batch-size", "1",
            "--train-iters", str(args.iters), "--optimizer", "adamw", "--lr", "1e-3", "--log-interval", "1",
            "--num-workers", str(workers), "--log-dir", log_dir]


def run(prefix: str, workers: int, args, log_dir: str) -> list[dict]:
    cmd = [sys.executable, *command(prefix, workers, args, log_dir)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        sys.exit(f"--num-workers {workers}: exit {out.returncode}\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    return [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--images", type=int, default=4, help="photos per row")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=768)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--global-batch-size", type=int, default=2)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        prefix, jpeg = make_dataset(d, args.rows, args.images, args.width, args.height)
        print(f"{args.rows} rows x {args.images} photos of {args.width} x {args.height} (JPEG, mean "
              f"{jpeg / 1e3:.0f} kB), preprocessed in {time.perf_counter() - t0:.1f} s; packs of "
              f"{args.seq_length} tokens, {args.global_batch_size} micro-batches of 1 pack per step, "
              f"{args.iters} steps (the first left out); {os.cpu_count()} CPU core(s)")
        print("$ python benchmarks/bench_loader.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv)))
        print("each setting: OMP_NUM_THREADS=1 python " + " ".join(
            command("DIR/out/photos_text_document", "N", args, "DIR/logN")))
        print("| --num-workers | data wait per step (s) | step time (s) | wait / step | images per step |")
        print("|---|---|---|---|---|")
        for n in args.workers:
            rows = run(prefix, n, args, os.path.join(d, f"log{n}"))[1:]
            wait = float(np.mean([r["data_wait_s"] for r in rows]))
            step = float(np.mean([r["step_ms"] for r in rows])) / 1000
            print(f"| {n} | {wait:.3f} | {step:.3f} | {100 * wait / step:.0f}% | "
                  f"{_images_per_step(prefix, args):.1f} |", flush=True)
    return 0


def _images_per_step(prefix: str, args) -> float:
    """Mean images per step over the measured steps, from the packs the loader reads (seed 1234:
    --seed's default)."""
    from data.loader import THDLoader, open_source
    from models.registry import image_processor_from_settings

    src = open_source(prefix, args.seq_length, "split", 1234, image_processor=image_processor_from_settings)
    loader = THDLoader([(1.0, src)], seq_length=args.seq_length, micro_batch_size=1, pad_id=0, seed=1234)
    packs = range(args.global_batch_size, args.global_batch_size * args.iters)
    n = sum(len(src.images.images_in(*seg)) for k in packs for seg in loader.global_pack(k)[1].tolist())
    return n / (args.iters - 1)


if __name__ == "__main__":
    sys.exit(main())
