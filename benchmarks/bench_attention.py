#!/usr/bin/env python3
"""THD attention against the two ways of running packed documents without THD support.

One pack of T tokens (default 8192) holding documents with lognormal lengths (median 300,
sigma 1), causal attention (full, or ``--window`` keys counting the query), GQA, forward +
backward:

* ``thd (sdpa blocks)``: our ``sdpa`` backend (``core/transformer/sdpa_blocks.py``), exact:
  query blocks against the keys they can see, long documents alone; its mask is built in
  every timed call (a model builds it once per micro-batch for all layers of a window);
* ``thd, blocks of B`` (``--blocks``): the same with the block size forced to B, the table
  behind ``sdpa_blocks.block_size``;
* ``pad to longest``: documents padded to the longest one, batched SDPA with a padding mask;
* ``dense block-diagonal``: one [T, T] mask over the whole pack, cost T^2.

Each method runs in a fresh subprocess; memory is its peak RSS above the inputs (CPU) or
``torch.cuda.max_memory_allocated`` (GPU).

    python benchmarks/bench_attention.py [--tokens 8192] [--heads 4] [--kv-heads 1] [--head-dim 128]
    python benchmarks/bench_attention.py --tokens 1024 --heads 6 --kv-heads 2 --head-dim 16 \
        --median 64 --window 8 --blocks 16 32 64 128      # block sizes at the tiny preset's shapes
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


def doc_lengths(T: int, seed: int = 0, median: float = 300) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < T:
        n = int(min(max(1, round(rng.lognormal(math.log(median), 1.0))), T - total))
        out.append(n)
        total += n
    return out


def run_method(method: str, T: int, H: int, KV: int, D: int, device: str, repeats: int,
               window: int | None = None, median: float = 300) -> dict:
    import torch
    import torch.nn.functional as F

    from core.packed_seq import PackedSeqParams
    from core.transformer import sdpa_blocks
    from core.transformer.attention_backends import DocLayout, sdpa_attention

    if method.startswith("thd:"):  # a forced block size
        block = int(method[4:])
        sdpa_blocks.block_size = lambda width: block
    lengths = doc_lengths(T, median=median)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, D, generator=g).to(device).requires_grad_()
    k = torch.randn(T, KV, D, generator=g).to(device).requires_grad_()
    v = torch.randn(T, KV, D, generator=g).to(device).requires_grad_()
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    params = PackedSeqParams(cu, cu.clone(), max(lengths))
    layout = DocLayout.from_params(params)
    scale = D ** -0.5

    def thd():  # a new micro-batch each call: the mask is built and used by one layer
        return sdpa_attention(q, k, v, DocLayout.from_params(params), window, scale)

    def causal(n):
        m = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
        return m & torch.triu(m, -(window - 1)) if window else m

    def padded():
        L, B = max(lengths), len(lengths)
        idx = torch.full((B, L), T, dtype=torch.long, device=device)  # T: a zero row
        for b, (s, n) in enumerate(zip(layout.starts, lengths)):
            idx[b, :n] = torch.arange(s, s + n, device=device)

        def gather(x):
            xz = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
            return xz[idx].transpose(1, 2)  # [B, heads, L, D]

        keep = idx < T
        mask = causal(L)[None] & keep[:, None, :]
        mask = mask | ~keep[:, :, None]  # padded query rows attend to something (discarded)
        o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), attn_mask=mask[:, None],
                                           scale=scale, enable_gqa=H != KV)
        return o.transpose(1, 2)[keep]

    def dense():
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                      torch.tensor(lengths, device=device))
        mask = (doc[:, None] == doc[None, :]) & causal(T)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                           enable_gqa=H != KV)
        return o[0].transpose(0, 1)

    fn = {"padded": padded, "dense": dense}.get(method, thd)
    grad = torch.randn(T, H, D, generator=g).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        out.backward(grad)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        q.grad = k.grad = v.grad = None
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    times.sort()
    w = window or T
    return {"seconds": times[len(times) // 2], "peak_bytes": max(peak, 0), "docs": len(lengths),
            "longest": max(lengths), "useful": sum(min(i + 1, w) for n in lengths for i in range(n))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, help="sliding window, keys counting the query (default: full)")
    ap.add_argument("--median", type=float, default=300, help="median document length (default 300)")
    ap.add_argument("--blocks", type=int, nargs="*", default=[], help="also our backend at these block sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--_method", help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = (args.tokens, args.heads, args.kv_heads, args.head_dim)
    if args._method:
        print(json.dumps(run_method(args._method, *shape, device, args.repeats, args.window, args.median)))
        return
    flags = ["--tokens", str(args.tokens), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
             "--head-dim", str(args.head_dim), "--median", str(args.median)] + \
        (["--window", str(args.window)] if args.window else [])
    rows = {}
    for method in ["thd"] + [f"thd:{b}" for b in args.blocks] + ["padded", "dense"]:
        cmd = [sys.executable, __file__, "--_method", method, "--repeats", str(args.repeats), "--device", device]
        out = subprocess.run(cmd + flags, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        rows[method] = json.loads(out.stdout.strip().splitlines()[-1])
    r = rows["thd"]
    print(f"attention fwd+bwd on {device}: T={args.tokens}, {r['docs']} documents (longest {r['longest']}), "
          f"{args.heads} query / {args.kv_heads} kv heads, head_dim {args.head_dim}, causal, "
          f"{f'window {args.window}' if args.window else 'full'}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'method':<26}{'seconds':>10}{'peak MiB':>11}{'vs thd':>9}")
    names = {"thd": "thd (sdpa blocks)", "padded": "pad to longest", "dense": "dense block-diagonal"}
    for m, row in rows.items():
        name = names.get(m, f"thd, blocks of {m[4:]}")
        print(f"{name:<26}{row['seconds']:>10.4f}{row['peak_bytes'] / 2**20:>11.0f}"
              f"{row['seconds'] / r['seconds']:>8.1f}x")
    print(f"useful score entries: {r['useful']:,} of {args.tokens**2:,} in the dense T x T block")
    print("reproduce: python benchmarks/bench_attention.py " + " ".join(flags)
          + (" --blocks " + " ".join(map(str, args.blocks)) if args.blocks else ""))


if __name__ == "__main__":
    main()
