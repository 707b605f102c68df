#!/usr/bin/env python3
"""Pack planner: time, fill and packs against the lower bound ceil(tokens / S), and TRL.

Documents have lognormal lengths (median 300, sigma 1.0, clipped to [1, 16384]) packed into
S = 8192. Each size runs in a fresh subprocess so its peak memory (RSS high-water mark above the
input array) is the planner's alone. The TRL column (``trl.data_utils.pack_dataset`` with
strategy "bfd") is filled when trl is installed, for sizes up to --trl-max-docs.

    python benchmarks/bench_packing.py [--docs 1000000 10000000] [--seq-length 8192]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def lengths_for(n: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(math.log(300), 1.0, n)), 1, 16384).astype(np.int64)


def measure_ours(n: int, S: int) -> dict:
    from data.packing import plan_packs

    lengths = lengths_for(n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    plan = plan_packs(lengths, S, long_docs="split", seed=0)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = int(lengths.sum())
    return {"seconds": seconds, "packs": plan.num_packs, "fill": plan.fill, "tokens": tokens,
            "bytes_per_doc": (peak - before) / n}


def measure_trl(n: int, S: int) -> dict:
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    lengths = lengths_for(n)
    ds = Dataset.from_dict({"input_ids": [[1] * int(L) for L in lengths]})
    t0 = time.perf_counter()
    packed = pack_dataset(ds, S, strategy="bfd")
    seconds = time.perf_counter() - t0
    tokens = int(lengths.sum())
    return {"seconds": seconds, "packs": len(packed), "fill": tokens / (len(packed) * S)}


def in_subprocess(fn: str, n: int, S: int) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.dirname(__file__)!r});"
            f"from bench_packing import {fn}; print(json.dumps({fn}({n}, {S})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--seq-length", type=int, default=8192)
    ap.add_argument("--trl-max-docs", type=int, default=1_000_000)
    args = ap.parse_args()
    try:
        import trl  # noqa: F401
        have_trl = True
    except ImportError:
        have_trl = False
    S = args.seq_length
    print(f"pack planning, lognormal(median 300, sigma 1) lengths in [1, 16384], S = {S}, "
          f"{os.cpu_count()} cores")
    head = f"{'docs':>11} {'':>8} {'seconds':>9} {'packs':>10} {'bound':>10} {'fill %':>9} {'B/doc':>7}"
    print(head)
    for n in args.docs:
        ours = in_subprocess("measure_ours", n, S)
        bound = math.ceil(ours["tokens"] / S)
        print(f"{n:>11,} {'ours':>8} {ours['seconds']:>9.3f} {ours['packs']:>10,} {bound:>10,} "
              f"{100 * ours['fill']:>9.4f} {ours['bytes_per_doc']:>7.1f}")
        if have_trl and n <= args.trl_max_docs:
            trl_r = in_subprocess("measure_trl", n, S)
            print(f"{'':>11} {'TRL bfd':>8} {trl_r['seconds']:>9.3f} {trl_r['packs']:>10,} {bound:>10,} "
                  f"{100 * trl_r['fill']:>9.4f} {'-':>7}")
        elif not have_trl:
            print(f"{'':>11} {'TRL bfd':>8} {'(trl not installed: column skipped)':>47}")
        gap = 100 * (ours["packs"] - bound) / bound
        print(f"{'':>11} {'':>8} packs above the lower bound: {ours['packs'] - bound} ({gap:.4f}%; "
              "target <= 0.01%)")
    print("targets: 1M docs < 0.5 s, 10M < 5 s, fill within 0.01% of the bound, < 40 B/doc")
    print("reproduce: python benchmarks/bench_packing.py --docs " + " ".join(map(str, args.docs)))


if __name__ == "__main__":
    main()
