"""Part (e): Muon's Newton-Schulz (``core/optim/muon.py``, 5 quintic steps in bf16) on one EP8
rank's stack of expert matrices (Step-3.7-Flash: [36, 1280, 4096], one projection of 36 of the
288 experts): time, TFLOP/s, and the time the planner assumes for it (``training/planner/timing.py``:
its Newton-Schulz FLOP count at ``--assumed-mfu`` of the peak). With ``--optimizer-in-backward``
this runs inside the backward for every matrix, so it is on the step's critical path.

Also a check that the result is orthogonal-ish: the singular values of quintic Newton-Schulz
land in about [0.7, 1.2] (it trades exactness for speed), so every ``X X^T`` diagonal entry must
be in [0.3, 1.5] and no entry NaN."""
from __future__ import annotations

import sys

from benchmarks.gpu_parts import common

import torch  # noqa: E402


def planned_flops(shape: tuple, steps: int) -> float:
    """The planner's FLOPs for orthogonalising one stack of this shape (its own count)."""
    from core.model_api import ParamSpec
    from training.planner.shares import ChunkShare, TensorShare
    from training.planner.inputs import optim_options
    from training.planner.timing import optimizer_work

    t = torch.empty(shape, device="meta")
    chunk = ChunkShare(0, False, False, (0,), (TensorShare(t, ParamSpec(), 0),))
    return optimizer_work(chunk, 1, 1, optim_options("muon", muon_ns_steps=steps))["dense"]["flops"]


def main(argv=None) -> int:
    args = common.parse(__doc__.split("\n\n")[0], argv)
    device = common.device_for(args)
    if device is None:
        return common.NO_CUDA
    from core.costs.flops import device_peak_tflops
    from core.optim.muon import newton_schulz
    from models import registry
    from training.planner.timing import TimeAssumptions, peak_tflops

    cfg = registry.resolve(common.preset_of(args))[1]
    moe = next(b.ffn for b in registry.shapes_of(cfg).blocks if b.ffn.moe)
    shape = (moe.experts // (4 if args.tiny else 8), moe.size, cfg.hidden_size)
    g = torch.Generator(device).manual_seed(args.seed)
    grad = torch.randn(shape, device=device, generator=g)
    out = {}

    def run():
        out["x"] = newton_schulz(grad, steps=5)

    ms = common.median_ms(run, device, warmup=2, iters=5)
    x = out["x"].float()
    diag = torch.diagonal(x @ x.mT, dim1=-2, dim2=-1)
    ok = bool(torch.isfinite(x).all()) and float(diag.min()) >= 0.3 and float(diag.max()) <= 1.5
    flops = planned_flops(shape, 5)
    peak = device_peak_tflops() if device.type == "cuda" else None
    planned_ms = flops / (TimeAssumptions().assumed_mfu * peak_tflops(None) * 1e12) * 1e3
    tflops = flops / ms / 1e9
    mfu = f", MFU {100 * tflops / peak:.0f}%" if peak else ""
    print(f"Newton-Schulz, 5 quintic steps in bf16 on {list(shape)}: {ms:.2f} ms (median of 5), {tflops:.3g} "
          f"TFLOP/s{mfu}; the planner assumes {planned_ms:.2f} ms; diag(X X^T) in [{float(diag.min()):.2f}, "
          f"{float(diag.max()):.2f}]")
    return common.finish(args, {"part": "e", "passed": ok, "shape": shape, "ms": ms, "tflops": tflops,
                                "planned_ms": planned_ms, "diag": [float(diag.min()), float(diag.max())],
                                "compare": [{"what": f"Newton-Schulz {list(shape)}", "measured": ms,
                                             "planned": planned_ms, "unit": "ms"}],
                                "headline": f"Newton-Schulz {list(shape)}: {ms:.2f} ms ({tflops:.3g} TFLOP/s), "
                                            f"planned {planned_ms:.2f} ms{'' if ok else '; result NOT orthogonal'}"})


if __name__ == "__main__":
    sys.exit(main())
