"""Part (a): flash ``varlen`` against ``sdpa`` in bf16, forward and backward, on one pack of 8192
tokens, at each attention shape of the model (Step-3.7-Flash: 96 and 64 query heads over 8 KV
heads of 128), windowed (the model's sliding window) and full.

Both bf16 kernels are measured against an fp32 ``sdpa`` reference on the same inputs: the
output and dq, dk, dv, each as max |error| / max |reference|. varlen passes when each of its
errors is at most twice bf16 sdpa's (+1e-3): flash must be as exact as the kernel we trust.
The pack's documents are longer than, about as long as, and shorter than the window (3500 down
to 15 tokens), so the window and the document boundaries both bite. Also timed: forward +
backward of each bf16 kernel (median of 3)."""
from __future__ import annotations

import itertools
import sys

from benchmarks.gpu_parts import common

import torch  # noqa: E402

LENGTHS = (3500, 1700, 1024, 700, 513, 400, 200, 100, 40, 15)  # 8192 tokens
NAMES = ("out", "dq", "dk", "dv")


def layout_of(lengths, device):
    from core.packed_seq import PackedSeqParams
    from core.transformer.attention_backends import DocLayout

    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return DocLayout.from_params(PackedSeqParams(cu, cu.clone(), max(lengths)).to(device))


def _fwd_bwd(fn, q, k, v, dy):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    y = fn(q, k, v)
    y.backward(dy)
    return y.detach(), q.grad, k.grad, v.grad


def compare(heads: int, kv_heads: int, head_dim: int, window: int | None, layout, device,
            seed: int = 0, time_it: bool = True) -> dict:
    """Errors of bf16 varlen and bf16 sdpa against fp32 sdpa; their forward + backward ms."""
    from core.transformer.attention_backends import sdpa_attention, varlen_attention

    g = torch.Generator(device).manual_seed(seed)
    T, scale = layout.total, head_dim ** -0.5
    q = torch.randn(T, heads, head_dim, device=device, generator=g)
    k, v = (torch.randn(T, kv_heads, head_dim, device=device, generator=g) for _ in range(2))
    dy = torch.randn(T, heads, head_dim, device=device, generator=g)
    sdpa = lambda q, k, v: sdpa_attention(q, k, v, layout, window, scale)  # noqa: E731
    flash = lambda q, k, v: varlen_attention(q, k, v, layout, window, scale)  # noqa: E731
    ref = _fwd_bwd(sdpa, q, k, v, dy)
    bf = [t.bfloat16() for t in (q, k, v, dy)]
    out = {"heads": heads, "kv_heads": kv_heads, "window": window}
    for name, fn in (("varlen", flash), ("sdpa_bf16", sdpa)):
        out[name] = {n: common.rel(a, r) for n, a, r in zip(NAMES, _fwd_bwd(fn, *bf), ref)}
        if time_it:
            out[name]["ms"] = common.median_ms(lambda: _fwd_bwd(fn, *bf), device, warmup=1, iters=3)
    out["passed"] = all(out["varlen"][n] <= 2 * out["sdpa_bf16"][n] + 1e-3 for n in NAMES)
    return out


def shapes_of(preset: str) -> list[tuple[int, int, int, int | None]]:
    """(heads, KV heads, head dim, window) to check: each attention shape of the model, with the
    model's sliding window and without."""
    from models import registry

    blocks = registry.shapes_of(registry.resolve(preset)[1]).blocks
    window = next((b.attention.window for b in blocks if b.attention.window), None)
    kinds = sorted({(b.attention.heads, b.attention.kv_heads, b.attention.head_dim) for b in blocks}, reverse=True)
    return [(h, kv, d, w) for h, kv, d in kinds for w in ((window, None) if window else (None,))]


def main(argv=None) -> int:
    args = common.parse(__doc__.split("\n\n")[0], argv)
    if args.tiny:
        print("part (a) needs CUDA (flash varlen has no CPU kernel); nothing to do with --tiny")
        return common.finish(args, {"part": "a", "passed": True, "rows": [],
                                    "skipped": ["--tiny: flash varlen is CUDA only"],
                                    "headline": "attention: skipped on the CPU"})
    device = common.device_for(args)
    if device is None:
        return common.NO_CUDA
    layout = layout_of(LENGTHS, device)
    rows = []
    print(f"{'heads':>9}{'window':>8}  {'kernel':<10}{'out':>9}{'dq':>9}{'dk':>9}{'dv':>9}{'fwd+bwd ms':>12}")
    for h, kv, d, w in shapes_of(args.model_preset):
        r = compare(h, kv, d, w, layout, device, args.seed)
        rows.append(r)
        for kernel in ("varlen", "sdpa_bf16"):
            e = r[kernel]
            print(f"{h:>5}/{kv:<3}{str(w or 'full'):>8}  {kernel:<10}" + "".join(f"{e[n]:>9.1e}" for n in NAMES)
                  + f"{e['ms']:>12.2f}" + ("" if kernel == "sdpa_bf16" or r["passed"] else "  FAILED"))
        common.free()
    worst = max(max(r["varlen"][n] for n in NAMES) for r in rows)
    speed = [r["sdpa_bf16"]["ms"] / r["varlen"]["ms"] for r in rows]
    passed = all(r["passed"] for r in rows)
    headline = (f"attention: varlen vs fp32 sdpa worst error {worst:.1e} over {len(rows)} shapes "
                f"({'as exact as' if passed else 'LESS exact than'} bf16 sdpa), "
                f"{min(speed):.1f}-{max(speed):.1f}x bf16 sdpa's speed")
    return common.finish(args, {"part": "a", "passed": passed, "rows": rows, "lengths": LENGTHS,
                                "headline": headline})


if __name__ == "__main__":
    sys.exit(main())
