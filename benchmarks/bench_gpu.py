#!/usr/bin/env python3
"""Two full-width MoE decoder layers of a registered model on one GPU: ours against transformers'
decoder layers of the same family, same weights, same packed tokens, forward + backward.

The slice (``--model-preset``, default ``step37-flash``; ``benchmarks/model_slice.py`` says how
each family is cut): for Step-3.7-Flash its first sliding-attention MoE layer and first
full-attention MoE layer (layers 3 and 4: 96 and 64 query heads, 8 KV heads, all 288 experts of
1280, top-8, the shared expert), 9.28 B parameters in bf16 (17.3 GiB); for Qwen3-30B-A3B its
first two layers (32 query and 4 KV heads, 128 experts of 768, top-8). The input: one pack of
``--seq-length`` tokens (8192) that our planner (``data/packing.py``) fills from documents with
log-normal lengths (median min(300, S/8) tokens, sigma 1, clipped to S, seeded), as THD
(``cu_seqlens``); the hidden states entering the slice are N(0, 1) and one N(0, 1) output
gradient drives both backwards. Timed: ``--warmup`` untimed steps, then ``--iters`` steps, each
forward + backward from the packed batch (rotary tables and masks included), median reported.

* ours: the family's chunk holding those layers (``models/<family>/model.py``) on THD, ``auto``
  attention (flash ``varlen`` on CUDA, blocked ``sdpa`` on CPU), grouped_mm experts. Built
  on the device (meta, then ``to_empty``) in bf16, with the router in fp32 (what the ``--bf16``
  FSDP path does) and the buffers ``core/precision.py`` keeps in fp32.
* transformers: its decoder layer (``Step3p7DecoderLayer``, ``Qwen3MoeDecoderLayer``) on the
  packed row ``[1, T, H]`` with per-document
  position ids, from which transformers' own mask builders make the block-diagonal causal mask
  (windowed on the sliding layer); ``sdpa`` attention and its per-expert loop; the router in
  fp32 too; rotary frequencies in fp32.

Before timing, the same two layer types of the family's tiny preset run on both in fp32 (ours
with ``sdpa``), non-trivial weights: output, input gradient and every parameter gradient must
agree within CHECK_REL, or nothing is timed (exit 1). transformers is optional at run time: where
it lacks the family (the lent H200's transformers 5.17 has no step3p7), the check and its row are
skipped, the report says so and why, and ours is still timed. TFLOP/s counts these two layers only with
``core/costs/flops.py``: 6 x matmul weights per real token + 12 x heads x head_dim per key each query
sees; MFU divides by ``--peak-tflops`` or the device's dense bf16 peak.

    python benchmarks/bench_gpu.py [--model-preset qwen3-30b-a3b] [--seq-length 8192] [--iters 10]
    python benchmarks/bench_gpu.py --tiny      # the same code, the family's tiny preset, CPU, ~15 s

docs/performance.md explains the columns; tools/gpu_check.sh runs this after the GPU tests.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.model_slice import (FAMILIES, build_hf, build_ours, check_equivalence,  # noqa: E402
                                    copy_weights, hf_missing, init_weights, packed_batch, relative_error,
                                    slice_config, slice_flops, weight_pairs)
from benchmarks.gpu_parts.common import memory_compare, planned_layers_gib  # noqa: E402
from models import registry  # noqa: E402

GiB = 2 ** 30
OURS = "ours (THD)"


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(model, x, dy, batch, warmup: int, iters: int, device) -> dict:
    """Median seconds of a forward + backward (gradients reset to None first, as
    ``zero_grad`` does), the first output, and the peak memory of the timed steps."""
    def step():
        model.zero_grad(set_to_none=True)
        x.grad = None
        y = model(x, batch)
        y.backward(dy)
        return y

    first = step().detach()
    for _ in range(max(warmup - 1, 0)):
        step()
    _sync(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            seconds.append((start, end))
        else:
            t0 = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - t0)
    _sync(device)
    if cuda:
        seconds = [s.elapsed_time(e) / 1e3 for s, e in seconds]
    peak = torch.cuda.max_memory_allocated(device) / GiB if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) / GiB if cuda else None
    return {"seconds": statistics.median(seconds), "peak_gib": peak, "peak_reserved_gib": reserved,
            "first_output": first}


def _oom(name: str, e: Exception) -> dict:
    return {"name": name, "error": f"out of memory: {str(e).splitlines()[0][:160]}"}


def _row(name: str, t: dict, tokens: int, flops: float, peak_tflops: float | None, planned_gib: float) -> dict:
    s, tflops = t["seconds"], flops / t["seconds"] / 1e12
    return {"name": name, "ms": 1e3 * s, "tokens_per_s": tokens / s, "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None, "peak_gib": t["peak_gib"],
            "peak_reserved_gib": t["peak_reserved_gib"], "planned_gib": planned_gib}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_benchmark(args, device, dtype, with_hf: bool = True) -> dict:
    """Ours, then transformers with ours' weights (ours freed before transformers is timed);
    ``with_hf=False``: ours alone (transformers' side is not available here)."""
    from core.costs.flops import device_peak_tflops

    cfg, idx = slice_config(registry.resolve(args.preset)[1])
    HF = args.hf_name
    batch, lengths = packed_batch(args.seq_length, args.seed)
    batch = batch.to(device)
    tokens, flops = sum(lengths), slice_flops(cfg, lengths)
    peak = args.peak_tflops or (device_peak_tflops() if device.type == "cuda" else None)
    g = torch.Generator(device).manual_seed(args.seed + 1)
    x = torch.randn(args.seq_length, cfg.hidden_size, device=device, generator=g, dtype=dtype).requires_grad_()
    dy = torch.randn(args.seq_length, cfg.hidden_size, device=device, generator=g, dtype=dtype)
    outputs = {}
    planned = {}  # the planner's figure for these layers: weights, gradients (as held), activations

    def timed(name, model):
        try:
            t = time_steps(model, x, dy, batch, args.warmup, args.iters, device)
        except torch.cuda.OutOfMemoryError as e:
            return _oom(name, e)
        outputs[name] = t["first_output"]
        return _row(name, t, tokens, flops, peak, planned["gib"])

    ours = build_ours(cfg, device, dtype)
    init_weights(ours, args.seed, std=cfg.init_std)
    params = sum(p.numel() for p in ours.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    planned["gib"] = planned_layers_gib(cfg, args.seq_length, weight_bytes, weight_bytes)  # grads as the weights
    rows = [timed(OURS, ours)]
    if args.compile:  # the same layers again, each compiled fullgraph (models/step37/compile.py)
        from core.compile import compile_block, raise_recompile_limit

        raise_recompile_limit(len(ours.layers))
        for layer in ours.layers.values():
            compile_block(layer)
        ours.zero_grad(set_to_none=True)
        rows.append(timed(OURS + " --compile", ours))
        outputs.pop(OURS + " --compile", None)
    ours.zero_grad(set_to_none=True)
    x.grad = None
    hf = None
    try:
        if with_hf:
            hf = build_hf(cfg, device, dtype, ours.chunk.router_fp32)
            copy_weights(weight_pairs(ours, hf))
    except torch.cuda.OutOfMemoryError as e:
        hf, rows = None, rows + [_oom(HF, e)]
    del ours
    _free()
    if hf is not None:
        rows.append(timed(HF, hf))
    diff = None
    if len(outputs) == 2:
        valid = torch.arange(args.seq_length, device=device) < tokens  # real tokens come first
        a, b = outputs[OURS][valid].float(), outputs[HF][valid].float()
        diff = {"max_rel": relative_error(a, b),
                "median_token_rel": float(((a - b).norm(dim=-1) / b.norm(dim=-1)).median())}
    return {"preset": args.preset, "hf_name": HF, "layers": idx, "parameters": params, "tokens": tokens, "documents": len(lengths),
            "longest": max(lengths), "seq_length": args.seq_length, "flops": flops,
            "peak_tflops": peak, "rows": rows, "output_diff": diff,
            "compare": [c for r in rows if "error" not in r for c in memory_compare(
                r["name"], {"peak_allocated_gib": r["peak_gib"], "peak_reserved_gib": r["peak_reserved_gib"]},
                r["planned_gib"])]}


# ---------------------------------------------------------------------------- report
def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(res: dict) -> list[str]:
    lines = [f"{'implementation':<24}{'ms/iter':>10}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}"
             f"{'peak GiB':>10}{'reserved':>10}{'planned':>9}{'speed':>8}"]
    ref = next((r["ms"] for r in res["rows"] if r["name"] == res.get("hf_name") and "error" not in r), None)
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"{r['name']:<24}  {r['error']}")
            continue
        speed = f"{ref / r['ms']:.2f}x" if ref else "-"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"{r['name']:<24}{r['ms']:>10.1f}{r['tokens_per_s']:>11,.0f}{r['tflops']:>9.3g}"
                     f"{mfu:>7}{_fmt(r['peak_gib'], '.2f'):>10}{_fmt(r['peak_reserved_gib'], '.2f'):>10}"
                     f"{_fmt(r['planned_gib'], '.2f'):>9}{speed:>8}")
    return lines


def summary(res: dict) -> str:
    ok = {r["name"]: r for r in res["rows"] if "error" not in r}
    ours, hf = ok.get(OURS), ok.get(res.get("hf_name"))
    c = res["check"]
    parts = [f"bench_gpu: {res['device']}",
             f"check skipped ({c['skipped']})" if "skipped" in c else f"check {'passed' if c['passed'] else 'FAILED'}"]
    if ours:
        mfu = f", MFU {100 * ours['mfu']:.1f}%" if ours["mfu"] else ""
        parts.append(f"ours {ours['tokens_per_s']:,.0f} tokens/s ({ours['tflops']:.3g} TFLOP/s{mfu}, "
                     f"peak {_fmt(ours['peak_gib'], '.1f')} GiB, reserved {_fmt(ours['peak_reserved_gib'], '.1f')}, "
                     f"planned {_fmt(ours['planned_gib'], '.1f')})")
    if hf:
        parts.append(f"transformers {hf['tokens_per_s']:,.0f} tokens/s (peak {_fmt(hf['peak_gib'], '.1f')} GiB)")
    if ours and hf:
        parts.append(f"ours {hf['ms'] / ours['ms']:.2f}x as fast")
    failed = [r["name"] for r in res["rows"] if "error" in r]
    return "; ".join(parts + [f"{', '.join(failed)} failed"] if failed else parts)


def report(args, res: dict) -> None:
    c = res["check"]
    if "skipped" in c:
        print(f"check skipped: {c['skipped']}; ours is timed alone, not compared with transformers")
    else:
        _report_check(c)
    if not c.get("passed", True):
        return
    _report_rows(args, res)


def _report_check(c: dict) -> None:
    print(f"check ({c['preset']} preset layers {c['layers']}, fp32 on {c['device']}, {c['tokens']} tokens in "
          f"{c['documents']} documents): largest difference to transformers relative to the largest "
          f"value: output {c['output']:.1e}, input grad {c['input_grad']:.1e}, parameter grads "
          f"{c['param_grads']:.1e} ({c['tensors']} tensors); tolerance {c['tolerance']:.0e}: "
          f"{'passed' if c['passed'] else 'FAILED, nothing timed'}")


def _report_rows(args, res: dict) -> None:
    n = res["parameters"]
    size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
    print(f"forward + backward on {res['device']}, bf16: {res['preset']} layers {res['layers']} (both MoE), "
          f"{size} parameters; one pack of "
          f"{args.seq_length} tokens: {res['documents']} documents, longest {res['longest']}, "
          f"{res['tokens']} real; {res['flops'] / 1e12:.4g} TFLOP per step (core/costs/flops.py); median of "
          f"{args.iters} steps after {args.warmup} warm-up")
    print("\n".join(format_table(res)))
    if res["output_diff"]:
        d = res["output_diff"]
        print(f"bf16 outputs, ours vs transformers: largest difference / largest value {d['max_rel']:.1e}, "
              f"median per token {d['median_token_rel']:.1e} (kernels differ; near-tie routing can flip)")
    print(f"reproduce: {res['command']}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Needs CUDA unless --tiny: exits 2 without it; 1 if the check "
                                        "fails or a side runs out of memory.")
    ap.add_argument("--model-preset", default="step37-flash",
                    help="the model whose slice is timed: a full-width preset of a family with a slice "
                         f"({', '.join(f.full for f in FAMILIES.values())}; default step37-flash)")
    ap.add_argument("--tiny", action="store_true",
                    help="the family's tiny preset on the CPU (bf16, 512 tokens, 1 warm-up, 3 steps): a smoke run")
    ap.add_argument("--seq-length", type=int, help="tokens in the pack (default 8192; 512 with --tiny)")
    ap.add_argument("--iters", type=int, help="timed steps (default 10; 3 with --tiny)")
    ap.add_argument("--warmup", type=int, help="untimed steps first, at least 1 (default 3; 1 with --tiny)")
    ap.add_argument("--peak-tflops", type=float,
                    help="dense bf16 peak for MFU (default: core/costs/flops.py by device name)")
    ap.add_argument("--compile", action="store_true",
                    help="also time our layers compiled (inductor, fullgraph per layer; the warm-up "
                         "steps include the compilation)")
    ap.add_argument("--seed", type=int, default=0, help="document lengths, weights and inputs (default 0)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)
    try:
        family = FAMILIES[registry.spec_for_preset(args.model_preset).family]
    except (ValueError, KeyError):
        ap.error(f"--model-preset {args.model_preset!r}: expected one of "
                 f"{', '.join(f.full for f in FAMILIES.values())}")
    args.preset, args.tiny_preset, args.hf_name = (family.tiny if args.tiny else args.model_preset), family.tiny, \
        family.hf_name
    args.family = family
    for name, full, tiny in (("seq_length", 8192, 512), ("iters", 10, 3), ("warmup", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def reproduce(args) -> str:
    cmd = "python benchmarks/bench_gpu.py" + (f" --model-preset {args.model_preset}" if args.model_preset != "step37-flash"
                                               else "")
    cmd += (" --tiny" if args.tiny else "") + (" --compile" if args.compile else "")
    cmd += f" --seq-length {args.seq_length} --iters {args.iters} --warmup {args.warmup} --seed {args.seed}"
    return cmd + (f" --peak-tflops {args.peak_tflops}" if args.peak_tflops else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("bench_gpu: needs a CUDA GPU (torch.cuda.is_available() is False here); "
              "--tiny runs the tiny preset on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:  # tiny shapes gain nothing from threads, and on shared CI cores they spin
        torch.set_num_threads(1)
    missing = hf_missing(args.family)
    check = {"skipped": missing} if missing else check_equivalence(device, args.seed, args.tiny_preset)
    res = {"device": "CPU" if args.tiny else torch.cuda.get_device_name(device),
           "command": reproduce(args), "check": check, "rows": [], "hf_name": args.hf_name,
           "skipped": [missing] if missing else []}
    passed = check.get("passed", True)  # a skipped check does not stop ours from being timed
    if passed:
        res.update(run_benchmark(args, device, torch.bfloat16, with_hf=not missing))
    report(args, res)
    print(summary(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if passed and all("error" not in r for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
