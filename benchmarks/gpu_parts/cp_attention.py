"""Part (i): context-parallel attention on one GPU, as CP rank 0 of CP4 computes it
(``core/context_parallel``): query boundaries unequal to key boundaries, causal aligned
bottom-right.

(1) Exactness. One pack of 12 documents (3 to 6,000 real tokens, each padded to a multiple of
2 x 4: some chunks longer than the window, some shorter so the halo spans several ranks, one
chunk all padding), at each attention shape of the model as part (a) reads them (Step-3.7-Flash:
96 and 64 query heads over 8 KV heads of 128), windowed (512: the halo plan) and full (the
document-prefix plan). The host plans are the code's own (``plan.py``); the exchange is made on
one process from the whole pack's K/V (the all-gather: every rank's rows in rank order; the
halo: the rows each other rank's plan sends rank 0), so autograd's backward sums dK/dV as the
reduce-scatter and the halo return do; then the code's ``attend_segments``. bf16 flash
``varlen`` and bf16 ``sdpa_segments`` are measured against fp32 ``sdpa_segments`` (output and dq,
dk, dv over the whole pack's K/V, each max |error| / max |reference|); varlen passes when each of
its errors is at most twice bf16 sdpa's (+1e-3), as in part (a). The fp32 reference itself must
equal the unsharded fp32 layer (``sdpa_attention`` over the whole pack) on rank 0's rows.

(2) The long pack. One 131,072-token document (the case ``costs.py`` counts), CP4 rank 0's
32,768 queries against their documents' prefixes (147,456 key rows) at the model's
full-attention shape (64 / 8 / 128) in bf16: forward and forward + backward time (CUDA events,
median of 3) and peak memory (allocated and reserved), printed beside what
``core/context_parallel/costs.py`` predicts for the key buffer and the gathered pool (and, for the
peak, the inputs plus those two).

``--tiny``: the tiny preset's shapes on a tiny pack and a 512-token document (in fp32), on the
CPU, with ``sdpa_segments`` in the place of flash (``varlen`` is CUDA only)."""
from __future__ import annotations

import itertools
import sys

from benchmarks.gpu_parts import common

import numpy as np  # noqa: E402
import torch  # noqa: E402

CP, RANK = 4, 0
LENGTHS = (6000, 3500, 1700, 1024, 700, 513, 400, 200, 100, 40, 15, 3)  # 14,195 real tokens
TINY_LENGTHS = (37, 20, 9, 3)
LONG, TINY_LONG = 131072, 512
NAMES = ("out", "dq", "dk", "dv")
UNSHARDED_TOL = 1e-4  # fp32 CP reference vs fp32 unsharded layer: the same sums in another order


def shards_of(lengths, cp: int = CP) -> list:
    """Every CP rank's ``CPShard`` of one pack of documents of ``lengths`` real tokens, each
    padded at its tail to a multiple of ``2 cp`` (what the pack planner does under CP)."""
    from core.context_parallel.shard import CPShard, real_end, shard_positions

    m = 2 * cp
    cu = (0, *itertools.accumulate(lengths))
    pad = (0, *itertools.accumulate(-(-n // m) * m for n in lengths))
    valid = np.arange(pad[-1]) < real_end(cu, pad)
    out = []
    for r in range(cp):
        index = shard_positions(pad, cp, r)
        out.append(CPShard(cp, r, cu, pad, index, torch.from_numpy(valid[index])))
    return out


def pool_positions(shards: list, rank: int, window: int | None) -> np.ndarray:
    """Pack positions of the rows of what rank ``rank``'s exchange returns: the all-gather's
    (every rank's rows in rank order; full) or its own rows then the halo rows each other rank's
    plan sends it, in rank order (sliding, ``exchange.halo_exchange``). The whole pack's K/V
    indexed by them is that pool, made on one process; autograd's backward of the index sums
    dK/dV as the reduce-scatter and the halo return do."""
    from core.context_parallel.plan import halo_plan

    if window is None:
        return np.concatenate([s.index for s in shards])
    mine, parts = halo_plan(shards[rank], window), [shards[rank].index]
    for o, s in enumerate(shards):
        send = halo_plan(s, window).send.get(rank) if o != rank else None
        assert (send is None) == (o not in mine.recv), (o, mine.recv)  # both sides plan the same messages
        if send is not None:
            assert len(send) == mine.recv[o], (o, len(send), mine.recv)
            parts.append(s.index[send])
    return np.concatenate(parts)


def _fwd_bwd(fn, q, kv, dy, kv_heads: int):
    q, kv = (t.detach().requires_grad_() for t in (q, kv))
    y = fn(q, kv)
    y.backward(dy)
    return y.detach(), q.grad, kv.grad[:, :kv_heads], kv.grad[:, kv_heads:]


def compare(heads: int, kv_heads: int, head_dim: int, window: int | None, shards: list, device,
            seed: int = 0, candidate: str = "varlen", rank: int = RANK) -> dict:
    """Errors of bf16 ``candidate`` and bf16 sdpa against fp32 sdpa on rank ``rank``'s segments;
    the fp32 reference's error against the unsharded fp32 layer."""
    from core.context_parallel.attention import attend_segments, device_plan
    from core.packed_seq import PackedSeqParams
    from core.transformer.attention_backends import DocLayout, sdpa_attention

    shard, N = shards[rank], len(shards)
    T, scale = shard.total, head_dim ** -0.5
    g = torch.Generator(device).manual_seed(seed)
    q_all = torch.randn(T, heads, head_dim, device=device, generator=g)
    kv = torch.randn(T, 2 * kv_heads, head_dim, device=device, generator=g)
    dy = torch.randn(T // N, heads, head_dim, device=device, generator=g)
    index = torch.from_numpy(shard.index).to(device)
    q = q_all.index_select(0, index)
    plan, valid = device_plan(shard, window, device), shard.valid.to(device)
    rows = torch.from_numpy(pool_positions(shards, rank, window)).to(device)
    run = lambda backend: lambda q, kv: attend_segments(  # noqa: E731
        q, kv.index_select(0, rows), kv_heads, plan, valid, window, scale, backend)
    ref = _fwd_bwd(run("sdpa"), q, kv, dy, kv_heads)
    layout = DocLayout.from_params(PackedSeqParams(torch.tensor(shard.cu_seqlens, dtype=torch.int32),
                                                   torch.tensor(shard.cu_seqlens_padded, dtype=torch.int32),
                                                   int(max(np.diff(shard.cu_seqlens_padded)))))
    whole = sdpa_attention(q_all, kv[:, :kv_heads], kv[:, kv_heads:], layout, window, scale)
    out = {"heads": heads, "kv_heads": kv_heads, "window": window, "queries": T // N,
           "key_rows": int(plan.host.cu_k[-1]), "segments": len(plan.host.cu_q) - 1,
           "ref_vs_unsharded": common.rel(ref[0], whole.index_select(0, index))}
    bf = [t.bfloat16() for t in (q, kv, dy)]
    for name, backend in (("varlen", candidate), ("sdpa_bf16", "sdpa")):
        out[name] = {n: common.rel(a, r) for n, a, r in zip(NAMES, _fwd_bwd(run(backend), *bf, kv_heads), ref)}
    out["passed"] = (all(out["varlen"][n] <= 2 * out["sdpa_bf16"][n] + 1e-3 for n in NAMES)
                     and out["ref_vs_unsharded"] <= UNSHARDED_TOL)
    return out


def pairs_of(plan) -> int:
    """Query-key pairs the segments compute (full attention, causal bottom-right): a chunk of
    ``q`` queries against ``k`` keys sees ``q (k - q) + q (q + 1) / 2``."""
    total = 0
    for qs, qe, ks, ke in zip(plan.cu_q[:-1], plan.cu_q[1:], plan.cu_k[:-1], plan.cu_k[1:]):
        nq, nk = qe - qs, ke - ks
        total += nq * (nk - nq) + nq * (nq + 1) // 2
    return total


def long_pack(T: int, heads: int, kv_heads: int, head_dim: int, device, backend: str, seed: int = 0,
              rank: int = RANK) -> dict:
    """One document of ``T`` tokens, CP rank ``rank``'s full-attention forward + backward."""
    from core.context_parallel import costs
    from core.context_parallel.attention import attend_segments, device_plan
    from core.costs.flops import avg_keys, device_peak_tflops
    from core.costs.shapes import AttentionShape
    from training.planner.timing import TimeAssumptions, peak_tflops

    common.free()
    shards = shards_of((T,))
    shard, N = shards[rank], len(shards)
    plan, valid, scale = device_plan(shard, None, device), shard.valid.to(device), head_dim ** -0.5
    dtype = common.compute_dtype(device)  # bf16; fp32 for --tiny on the CPU (the code path only)
    g = torch.Generator(device).manual_seed(seed)
    q = torch.randn(T // N, heads, head_dim, device=device, generator=g).to(dtype).requires_grad_()
    kv = torch.randn(T, 2 * kv_heads, head_dim, device=device, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(T // N, heads, head_dim, device=device, generator=g).to(dtype)
    rows = torch.from_numpy(pool_positions(shards, rank, None)).to(device)  # the all-gather's output
    fwd = lambda: attend_segments(q, kv.index_select(0, rows), kv_heads, plan, valid,  # noqa: E731
                                  None, scale, backend)
    finite = []

    def step():
        q.grad = kv.grad = None
        y = fwd()
        y.backward(dy)
        finite.append(torch.isfinite(q.grad).all() & torch.isfinite(kv.grad).all())  # read after timing

    with torch.no_grad():
        fwd_ms = common.median_ms(fwd, device, warmup=1, iters=3)
    common.reset_peak(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    ms = common.median_ms(step, device, warmup=1, iters=3)
    mem = common.peak_memory(device)
    peak = mem["peak_allocated_gib"]
    a = AttentionShape(heads, kv_heads, head_dim, None)
    pairs = pairs_of(plan.host)
    flops = 12.0 * heads * head_dim * pairs  # forward 4 H D per pair, backward twice it (core/costs/flops.py)
    peak_tf = device_peak_tflops() if device.type == "cuda" else None
    key_rows = int(plan.host.cu_k[-1])
    # the planner's time for it: its attention FLOPs (T / N queries, each seeing a causal
    # document's mean keys) at --assumed-mfu of the peak, as every matmul of the step
    assumed = TimeAssumptions().assumed_mfu
    planned_ms = 12.0 * heads * head_dim * (T // N) * avg_keys(T, None) / (assumed * peak_tflops(None) * 1e12) * 1e3
    out = {"tokens": T, "cp": N, "rank": rank, "queries": T // N, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "backend": backend, "key_rows": key_rows,
           "key_rows_predicted": costs.key_rows(a, T, N), "fwd_ms": fwd_ms, "ms": ms,
           "tflops": flops / ms / 1e9, "planned_ms": planned_ms, "assumed_mfu": assumed,
           "mfu": flops / ms / 1e9 / peak_tf if peak_tf else None, "finite": bool(torch.stack(finite).all()),
           "peak_gib": peak, "inputs_gib": base / common.GiB if device.type == "cuda" else None,
           "key_buffer_gib": key_rows * costs.kv_row_bytes(a, 2) / common.GiB,
           "predicted_key_buffer_gib": costs.key_buffer_bytes(a, T, N, 2) / common.GiB,
           "predicted_gathered_gib": costs.gathered_bytes(a, T, N, 2) / common.GiB, **mem}
    # the planner's figure for the peak: the inputs, costs.py's key buffer and gathered pool
    out["planned_peak_gib"] = (out["inputs_gib"] + out["predicted_key_buffer_gib"] + out["predicted_gathered_gib"]
                               if device.type == "cuda" else None)
    out["compare"] = common.memory_compare(f"CP{N} shard of {T} tokens fwd+bwd", mem, out["planned_peak_gib"])
    return out


def full_shape(preset: str) -> tuple[int, int, int]:
    """(heads, KV heads, head dim) of the model's full-attention layers."""
    from models import registry

    blocks = registry.shapes_of(registry.resolve(preset)[1]).blocks
    a = next(b.attention for b in blocks if b.attention.window is None)
    return a.heads, a.kv_heads, a.head_dim


def main(argv=None) -> int:
    from benchmarks.gpu_parts.attention import shapes_of

    args = common.parse(__doc__.split("\n\n")[0], argv)
    device = common.device_for(args)
    if device is None:
        return common.NO_CUDA
    preset = common.preset_of(args)
    candidate = "sdpa" if args.tiny else "varlen"
    skipped = ["--tiny: flash varlen is CUDA only; bf16 sdpa_segments stands in for it"] if args.tiny else []
    shards = shards_of(TINY_LENGTHS if args.tiny else LENGTHS)
    rows = []
    print(f"CP{CP} rank {RANK} of a pack of {len(shards[0].cu_seqlens) - 1} documents ({shards[0].total} tokens "
          f"padded): its {shards[0].total // CP} queries against their keys")
    print(f"{'heads':>9}{'window':>8}{'key rows':>10}  {'kernel':<10}{'out':>9}{'dq':>9}{'dk':>9}{'dv':>9}"
          f"{'fp32 vs unsharded':>19}")
    for h, kv, d, w in shapes_of(preset):
        r = compare(h, kv, d, w, shards, device, args.seed, candidate)
        rows.append(r)
        for kernel in ("varlen", "sdpa_bf16"):
            e = r[kernel]
            print(f"{h:>5}/{kv:<3}{str(w or 'full'):>8}{r['key_rows']:>10}  {kernel:<10}"
                  + "".join(f"{e[n]:>9.1e}" for n in NAMES)
                  + (f"{r['ref_vs_unsharded']:>19.1e}" if kernel == "varlen" else "")
                  + ("" if kernel == "sdpa_bf16" or r["passed"] else "  FAILED"))
        common.free()
    h, kv, d = full_shape(preset)
    long = long_pack(TINY_LONG if args.tiny else LONG, h, kv, d, device, candidate, args.seed)
    gib = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"long pack: one document of {long['tokens']} tokens, CP{CP} rank {RANK}: {long['queries']} queries "
          f"x {long['key_rows']} key rows (costs.key_rows predicts {long['key_rows_predicted']}), {h}/{kv} heads "
          f"of {d}, {str(common.compute_dtype(device)).split('.')[1]} {candidate}")
    print(f"  measured: forward {long['fwd_ms']:.1f} ms, forward + backward {long['ms']:.1f} ms, "
          f"{long['tflops']:.0f} TFLOP/s (12 H D per query-key pair), peak {gib(long['peak_gib'])} GiB allocated, "
          f"{gib(long['peak_reserved_gib'])} reserved, planned {gib(long['planned_peak_gib'])} "
          f"(inputs q, K/V, dy: {gib(long['inputs_gib'])} GiB), key buffer {long['key_buffer_gib']:.2f} GiB")
    print(f"  predicted (core/context_parallel/costs.py): key buffer kept for the backward "
          f"{long['predicted_key_buffer_gib']:.2f} GiB, gathered pool (transient) {long['predicted_gathered_gib']:.2f} GiB; "
          f"(training/planner/timing.py, at {long['assumed_mfu']:.0%} of the peak) forward + backward "
          f"{long['planned_ms']:.1f} ms")
    worst = max(max(r["varlen"][n] for n in NAMES) for r in rows)
    exact = all(r["passed"] for r in rows)
    passed = exact and long["finite"] and long["key_rows"] == long["key_rows_predicted"]
    headline = (f"cp attention: {candidate} vs fp32 worst error {worst:.1e} over {len(rows)} shapes "
                f"({'as exact as' if exact else 'LESS exact than (or reference off)'} bf16 sdpa); {long['tokens']} "
                f"tokens CP{CP} rank {RANK}: fwd+bwd {long['ms']:.0f} ms (planned {long['planned_ms']:.0f}), "
                f"peak {gib(long['peak_gib'])} GiB "
                f"(reserved {gib(long['peak_reserved_gib'])}, planned {gib(long['planned_peak_gib'])}), "
                f"key buffer {long['key_buffer_gib']:.2f} GiB (predicted {long['predicted_key_buffer_gib']:.2f})")
    timing = {"what": f"CP{CP} shard of {long['tokens']} tokens fwd+bwd", "measured": long["ms"],
              "planned": long["planned_ms"], "unit": "ms"}
    return common.finish(args, {"part": "i", "passed": passed, "rows": rows, "long": long,
                                "compare": [timing, *long["compare"]],
                                "lengths": TINY_LENGTHS if args.tiny else LENGTHS, "skipped": skipped,
                                "headline": headline})


if __name__ == "__main__":
    sys.exit(main())
