#!/usr/bin/env python3
"""Opening an MMIDIDX dataset: the full index validation against the cost of reading the index.

``IndexedDataset`` checks every entry at open (sizes >= 0, each offset the running sum of the
sizes before it, document indices in range and non-decreasing, the ``.bin`` size). The bound
it is compared with is the least any O(n) check must do: read every byte of the index once
(a sum over the three memory-mapped arrays). The "first/last only" row is the check this
replaced (and roughly what Megatron-LM's reader does: none), for scale.

The index is generated with random sizes; the ``.bin`` is a sparse file of the right size, so
no data is written. Timings are the best of ``--repeat`` runs with the index in the page cache
(a first open from a cold disk adds the time to read the index from storage).

    python benchmarks/bench_index_open.py [--entries 100000000] [--repeat 3] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data.indexed_dataset import HEADER_SIZE, MAGIC, IndexedDataset  # noqa: E402


def write_index(prefix: str, n: int, seed: int = 0) -> int:
    """A valid ``n``-sequence uint16 index, written in blocks; returns the .bin size in bytes."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 2048, n, dtype=np.int32)
    block = 1 << 24
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, 8, n, n + 1))
        f.write(sizes.tobytes())
        total = 0
        for a in range(0, n, block):  # byte offsets: running sum of sizes x 2
            ends = np.cumsum(sizes[a:a + block], dtype=np.int64) * 2 + total
            f.write((ends - sizes[a:a + block].astype(np.int64) * 2).tobytes())
            total = int(ends[-1])
        for a in range(0, n + 1, block):  # document indices 0..n
            f.write(np.arange(a, min(a + block, n + 1), dtype=np.int64).tobytes())
        assert f.tell() == HEADER_SIZE + 20 * n + 8
    with open(prefix + ".bin", "wb") as f:
        f.truncate(total)  # sparse: no data blocks written
    return total


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the index (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        prefix = os.path.join(d, "bench")
        t0 = time.perf_counter()
        write_index(prefix, args.entries)
        print(f"wrote a {args.entries:,}-entry index ({os.path.getsize(prefix + '.idx') / 2**30:.2f} GiB) "
              f"in {time.perf_counter() - t0:.1f} s")

        ds = IndexedDataset(prefix)

        def read_once():
            ds.lengths.sum(dtype=np.int64), ds.pointers.sum(), ds.document_indices.sum()

        def first_last():
            ds.pointers[0] == 0 and ds.pointers[-1] + int(ds.lengths[-1]) * 2 == os.path.getsize(prefix + ".bin")

        rows = [("IndexedDataset(prefix): full validation", best(lambda: IndexedDataset(prefix), args.repeat)),
                ("bound: read every index byte once", best(read_once, args.repeat)),
                ("first/last pointer only (the old check)", best(first_last, args.repeat))]
    print(f"\n{'':<44} {'seconds':>9} {'x bound':>8}")
    for name, t in rows:
        print(f"{name:<44} {t:>9.3f} {t / rows[1][1]:>8.2f}")
    print(f"\nentries {args.entries:,}, best of {args.repeat}, index in the page cache; reproduce with:\n"
          f"    python benchmarks/bench_index_open.py --entries {args.entries} --repeat {args.repeat}")


if __name__ == "__main__":
    main()
