#!/usr/bin/env python3
"""tools/preprocess_data.py against the physical limit of its job, on JSONL and on Parquet.

The limit: the same tokenizer encoding the same texts with the same number of worker processes,
texts already in memory (no file reading, no JSON, no writing). The tool is run as a real
subprocess on a generated JSONL file and on the same rows as a Parquet file (snappy, row groups
of 8,192 rows, what pyarrow and datasets write by default in spirit: many row groups); its peak
memory is the largest summed RSS of the tool and its workers, sampled every 50 ms.

    python benchmarks/bench_preprocess.py [--mb 200] [--workers 2] [--tokenizer hf|byte]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "data"))


def make_jsonl(path: str, mb: float, seed: int = 0) -> None:
    from make_sample_data import paragraph

    rng = random.Random(seed)
    target = int(mb * 2**20)
    with open(path, "w", encoding="utf-8") as f:
        written = 0
        while written < target:
            line = json.dumps({"text": paragraph(rng, max(1, int(rng.lognormvariate(2.5, 0.9))))},
                              ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line)


def make_parquet(jsonl: str, path: str) -> None:
    """The JSONL's rows as Parquet, read and written a block at a time."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    reader = pj.open_json(jsonl, read_options=pj.ReadOptions(block_size=16 << 20))
    writer = None
    for batch in reader:
        if writer is None:
            writer = pq.ParquetWriter(path, batch.schema, compression="snappy")
        writer.write_batch(batch, row_group_size=8192)
    writer.close()


def make_hf_tokenizer(path: str, sample_file: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(sample_file, encoding="utf-8") as f:
        texts = [json.loads(next(f))["text"] for _ in range(5000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=8000, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)


def _raw_worker(args):
    """Load this worker's share of texts (untimed), wait for all, then time encoding only."""
    path, rank, world, tok_type, tok_model, barrier, out = args
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from data.tokenizers import build_tokenizer

    tok = build_tokenizer(tok_type, tok_model)
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for i, line in enumerate(f) if i % world == rank]
    batch = 2000
    barrier.wait()
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(texts), batch):
        n += sum(len(ids) for ids in tok.encode_batch(texts[i:i + batch]))
    out.put((n, t0, time.perf_counter()))


def raw_throughput(path, workers, tok_type, tok_model) -> tuple[int, float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_raw_worker, args=((path, r, workers, tok_type, tok_model, barrier, out),))
             for r in range(workers)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    tokens = sum(r[0] for r in results)
    return tokens, max(r[2] for r in results) - min(r[1] for r in results)


def run_tool(path, prefix, workers, tok_type, tok_model) -> tuple[int, float, float]:
    import psutil

    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", path,
           "--output-prefix", prefix, "--workers", str(workers), "--tokenizer-type", tok_type]
    if tok_model:
        cmd += ["--tokenizer-model", tok_model]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ps, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss + sum(c.memory_info().rss for c in ps.children(recursive=True))
            peak = max(peak, rss)
        except psutil.Error:
            pass
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"preprocess_data failed:\n{out}")
    tokens = int(re.search(r", tokens ([\d,]+),", out).group(1).replace(",", ""))
    return tokens, seconds, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=200.0, help="size of the generated JSONL")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokenizer", choices=["hf", "byte"], default="hf",
                    help="hf: a byte-level BPE (vocab 8000) trained here; byte: built-in")
    ap.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "bench_preprocess"))
    args = ap.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    path = os.path.join(args.work_dir, f"input_{args.mb:g}mb.jsonl")
    if not os.path.exists(path):
        print(f"generating {args.mb:g} MB of JSONL at {path} ...", flush=True)
        make_jsonl(path + ".tmp", args.mb)
        os.replace(path + ".tmp", path)
    tok_type, tok_model = "byte", None
    if args.tokenizer == "hf":
        tok_type, tok_model = "huggingface", os.path.join(args.work_dir, "hf_tokenizer")
        if not os.path.exists(tok_model):
            make_hf_tokenizer(tok_model, path)

    parquet = path[:-len(".jsonl")] + ".parquet"
    if not os.path.exists(parquet):
        make_parquet(path, parquet + ".tmp")
        os.replace(parquet + ".tmp", parquet)

    raw_tokens, raw_s = raw_throughput(path, args.workers, tok_type, tok_model)
    runs = {}
    for name, src in (("JSONL", path), ("Parquet", parquet)):
        tokens, seconds, peak = run_tool(src, os.path.join(args.work_dir, "out_" + name.lower()),
                                         args.workers, tok_type, tok_model)
        assert tokens == raw_tokens, (name, tokens, raw_tokens)
        runs[name] = (tokens / seconds, seconds, peak)
    raw_rate = raw_tokens / raw_s
    print(f"\npreprocess: {os.path.getsize(path) / 2**20:.0f} MB JSONL ({os.path.getsize(parquet) / 2**20:.0f} MB "
          f"as Parquet), {raw_tokens:,} tokens, tokenizer {args.tokenizer}, {args.workers} workers, "
          f"{os.cpu_count()} cores")
    print(f"{'':36}{'tokens/s':>14}{'seconds':>10}{'peak RSS':>12}{'vs raw':>9}")
    print(f"{'raw tokenizer (the bound)':36}{raw_rate:>14,.0f}{raw_s:>10.1f}{'-':>12}{1:>9.3f}")
    for name, (rate, seconds, peak) in runs.items():
        print(f"{'tools/preprocess_data.py, ' + name:36}{rate:>14,.0f}{seconds:>10.1f}"
              f"{peak / 2**20:>8.0f} MiB{rate / raw_rate:>9.3f}")
    worst = min(r[0] for r in runs.values()) / raw_rate
    print(f"lowest ratio tool/raw: {worst:.3f} (target >= 0.85); peak memory "
          f"{max(r[2] for r in runs.values()) / 2**30:.2f} GiB (target < 1 GiB)")
    print(f"reproduce: python benchmarks/bench_preprocess.py --mb {args.mb:g} --workers {args.workers} "
          f"--tokenizer {args.tokenizer}")


if __name__ == "__main__":
    main()
