"""Part (b): grouped_mm experts against the per-expert loop, forward and backward, at full width
(Step-3.7-Flash: hidden 4096, experts of 1280), for all the model's experts (288) on one pack's
rows (8192 tokens x top-8) and for one EP8 rank's share (36) on a micro-batch of 4 packs' rows
(32768 x 8: each rank receives, on average, as many rows as it sends), with uneven counts and some
experts given no row at all.

Both run in bf16 (the loop: one matmul per expert) and are measured against the loop in fp32 on
the same weights: output, input gradient and the three weight gradients, each max |error| / max
|reference|. grouped_mm passes when each of its errors is at most twice the bf16 loop's (+1e-3),
when every empty expert's weight gradient is exactly zero, and when its forward + backward makes
no device sync. Also timed (median of 3) with TFLOP/s (6 x rows x 3 x hidden x expert size)."""
from __future__ import annotations

import sys

from benchmarks.gpu_parts import common

import torch  # noqa: E402

NAMES = ("out", "dx", "d_gate", "d_up", "d_down")


def uneven_counts(experts: int, rows: int, g: torch.Generator) -> torch.Tensor:
    """Skewed counts summing to ``rows`` (a few experts busy, many light) with experts 0, 1 and
    the last given none (only expert 0 with fewer than 8 experts; int64 on the CPU)."""
    weights = torch.rand(experts, generator=g) ** 4 + 1e-3
    weights[[0, 1, experts - 1] if experts >= 8 else [0]] = 0
    counts = torch.bincount(torch.multinomial(weights, rows, replacement=True, generator=g), minlength=experts)
    return counts


def _fwd_bwd(ex, x, counts, dy):
    ex.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = ex(x, counts)
    y.backward(dy)
    return (y.detach(), x.grad, ex.gate_proj.grad, ex.up_proj.grad, ex.down_proj.grad)


def compare(experts: int, hidden: int, size: int, rows: int, device, seed: int = 0, time_it: bool = True) -> dict:
    from core.moe.experts import GroupedExperts

    g = torch.Generator().manual_seed(seed)
    counts_cpu = uneven_counts(experts, rows, g)
    counts = counts_cpu.to(device)
    gd = torch.Generator(device).manual_seed(seed)
    ex = GroupedExperts(experts, hidden, size).to(device)
    for p in ex.parameters():
        p.data.normal_(0, hidden ** -0.5, generator=gd)
    x = torch.randn(rows, hidden, device=device, generator=gd)
    dy = torch.randn(rows, hidden, device=device, generator=gd)
    ex.use_grouped_mm = False
    ref = [t.clone() for t in _fwd_bwd(ex, x, counts, dy)]  # the fp32 loop; copies: .bfloat16() below
    ex.zero_grad(set_to_none=True)                           # would convert the gradients in place
    ex.bfloat16()
    xb, dyb = x.bfloat16(), dy.bfloat16()
    out = {"experts": experts, "rows": rows, "empty": int((counts_cpu == 0).sum())}
    flops = 6 * rows * 3 * hidden * size
    for name, grouped in (("grouped_mm", True), ("loop_bf16", False)):
        ex.use_grouped_mm = grouped
        with common.syncs_listed(device) as syncs:
            got = _fwd_bwd(ex, xb, counts, dyb)
        out[name] = {n: common.rel(a, r) for n, a, r in zip(NAMES, got, ref)}
        out[name]["syncs"] = len(syncs)
        if grouped:
            empty = (counts_cpu == 0).nonzero().flatten().tolist()
            out["empty_grads_zero"] = all(float(t[e].abs().max()) == 0.0 for t in got[2:] for e in empty)
            out["sync_sites"] = syncs
        if time_it:
            ms = common.median_ms(lambda: _fwd_bwd(ex, xb, counts, dyb), device, warmup=1, iters=3)
            out[name].update(ms=ms, tflops=flops / ms / 1e9)
    out["passed"] = (all(out["grouped_mm"][n] <= 2 * out["loop_bf16"][n] + 1e-3 for n in NAMES)
                     and out["empty_grads_zero"] and out["grouped_mm"]["syncs"] == 0)
    return out


def cases(preset: str, tiny: bool) -> list[tuple[int, int, int, int]]:
    """(experts, hidden, expert size, rows): every expert on one pack's rows, and an EP8 rank's
    share on four packs' (the recipe's micro-batch)."""
    from models import registry

    cfg = registry.resolve(preset)[1]
    moe = next(b.ffn for b in registry.shapes_of(cfg).blocks if b.ffn.moe)
    seq = 256 if tiny else 8192
    ep = 4 if tiny else 8  # the tiny preset has 8 experts
    return [(moe.experts, cfg.hidden_size, moe.size, seq * moe.top_k),
            (moe.experts // ep, cfg.hidden_size, moe.size, 4 * seq * moe.top_k)]


def main(argv=None) -> int:
    args = common.parse(__doc__.split("\n\n")[0], argv)
    device = common.device_for(args)
    if device is None:
        return common.NO_CUDA
    rows = []
    print(f"{'experts':>8}{'rows':>9}{'empty':>6}  {'kernel':<11}" + "".join(f"{n:>9}" for n in NAMES)
          + f"{'syncs':>7}{'ms':>9}{'TFLOP/s':>9}")
    for E, H, size, n in cases(common.preset_of(args), args.tiny):
        r = compare(E, H, size, n, device, args.seed)
        rows.append(r)
        for k in ("grouped_mm", "loop_bf16"):
            e = r[k]
            print(f"{E:>8}{n:>9}{r['empty']:>6}  {k:<11}" + "".join(f"{e[x]:>9.1e}" for x in NAMES)
                  + f"{e['syncs']:>7}{e['ms']:>9.2f}{e['tflops']:>9.3g}")
        if not r["empty_grads_zero"]:
            print("  FAILED: an expert that got no row has a non-zero weight gradient")
        for site in r["sync_sites"]:
            print(f"  grouped_mm sync: {site}")
        common.free()
    passed = all(r["passed"] for r in rows)
    exact = all(r["grouped_mm"][n] <= 2 * r["loop_bf16"][n] + 1e-3 for r in rows for n in NAMES)
    syncs = sum(r["grouped_mm"]["syncs"] for r in rows)
    speed = ", ".join(f"{r['experts']} experts {r['loop_bf16']['ms'] / r['grouped_mm']['ms']:.1f}x" for r in rows)
    headline = (f"experts: grouped_mm {'as exact as' if exact else 'LESS exact than'} the bf16 loop, empty "
                f"experts' dW {'zero' if all(r['empty_grads_zero'] for r in rows) else 'NOT zero'}, {syncs} syncs; "
                f"speed vs the loop: {speed}")
    return common.finish(args, {"part": "b", "passed": passed, "rows": rows, "headline": headline})


if __name__ == "__main__":
    sys.exit(main())
