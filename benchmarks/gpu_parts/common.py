"""What every GPU-check part shares: its command line (``--model-preset``, ``--json``, ``--tiny``
for a CPU smoke run of the same code), timing with CUDA events, the syncs a piece of code makes,
error measures, and the JSON result (``passed``, a one-line ``headline``, what was ``skipped``)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

GiB = 2 ** 30
NO_CUDA = 2  # exit status without CUDA (and without --tiny), as bench_gpu.py


def parse(description: str, argv=None, extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model-preset", default="step37-flash", help="a registered full-width preset (default "
                                                                   "step37-flash)")
    ap.add_argument("--tiny", action="store_true", help="the family's tiny preset on the CPU: the code path only")
    ap.add_argument("--json", metavar="PATH", help="write the result as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    if extra:
        extra(ap)
    return ap.parse_args(argv)


def device_for(args) -> torch.device | None:
    """CUDA, or the CPU with ``--tiny``; ``None`` (after saying so) when neither applies."""
    if args.tiny:
        torch.set_num_threads(min(2, torch.get_num_threads()))
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (torch.cuda.is_available() is False here); --tiny runs the code on the CPU",
              file=sys.stderr)
        return None
    return torch.device("cuda")


def compute_dtype(device) -> torch.dtype:
    """bf16 on a GPU (what --bf16 computes in); fp32 for --tiny on the CPU, where bf16 attention
    is slow and only the code path is being run."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def preset_of(args) -> str:
    """The preset a part builds: ``--model-preset``, or its family's tiny one with ``--tiny``."""
    from benchmarks.model_slice import FAMILIES
    from models import registry

    family = FAMILIES.get(registry.spec_for_preset(args.model_preset).family)
    if family is None:
        raise SystemExit(f"--model-preset {args.model_preset}: no slice is defined for its family "
                         f"(benchmarks/model_slice.py FAMILIES)")
    return family.tiny if args.tiny else args.model_preset


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device, warmup: int = 2, iters: int = 5) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` untimed calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    cuda, times = device.type == "cuda", []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            times.append((a, b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    sync(device)
    return statistics.median(a.elapsed_time(b) for a, b in times) if cuda else statistics.median(times)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def peak_memory(device) -> dict:
    """The caching allocator's peaks since ``reset_peak``: what tensors held (allocated) and what
    the allocator held from the device (reserved: side-stream pools, fragmentation, cached
    blocks); ``None`` on the CPU."""
    cuda = device.type == "cuda"
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB if cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB if cuda else None}


def memory_compare(what: str, peak: dict, planned_gib: float | None) -> list[dict]:
    """Two ``compare`` rows of a part's JSON (tools/gpu_check.py lifts them into results.json):
    the peak allocated and the peak reserved, each beside the planner's figure."""
    return [{"what": f"{what}: peak {kind}", "measured": peak.get(f"peak_{kind}_gib"), "planned": planned_gib,
             "unit": "GiB"} for kind in ("allocated", "reserved")]


def memory_text(peak: dict, planned_gib: float | None) -> str:
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return (f"peak {f(peak.get('peak_allocated_gib'))} GiB allocated, {f(peak.get('peak_reserved_gib'))} reserved, "
            f"planned {f(planned_gib)}")


def planned_layers_gib(cfg, T: int, weight_bytes: int, grad_bytes: int, recompute: str = "none") -> float:
    """The planner's device memory for a slice's decoder layers (all of ``cfg``'s) run forward +
    backward alone in bf16: the weights and gradients as held, and ``training/planner/memory.py``'s
    activations (``core/costs/activations.py``; the input kept for its gradient included) and recompute
    working set for a stage of those layers that is neither first nor last."""
    from types import SimpleNamespace

    from core.memory_mode import MemoryMode
    from training.planner.inputs import PlanInputs
    from training.planner.memory import _chunk_activations, _recompute_working_set

    chunk = SimpleNamespace(layers=tuple(range(cfg.num_layers)), first=False, last=False)
    inp = PlanInputs(mode=MemoryMode(bf16=True, recompute_granularity=recompute), seq_length=T, micro_batch_size=1)
    held = _chunk_activations(cfg, chunk, T, 2, inp) + _recompute_working_set(cfg, chunk, T, 2, inp)
    return (weight_bytes + grad_bytes + held) / GiB


def reset_peak(device) -> None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@contextmanager
def syncs_listed(device):
    """Every device sync of the block, as ``torch.cuda.set_sync_debug_mode("warn")`` reports it,
    each with the innermost Python frame outside torch that made it (nothing on the CPU)."""
    found: list[str] = []
    if device.type != "cuda":
        yield found
        return
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return old(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename
                  and "warnings" not in f.filename and not f.filename.endswith("common.py")]
        where = f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames else f"{filename}:{lineno}"
        found.append(f"{where}: {str(message).splitlines()[0][:120]}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            sync(device)
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old


def finish(args, result: dict) -> int:
    """Print the headline, write the JSON, return the exit status (0 passed, 1 failed)."""
    result.setdefault("skipped", [])
    result["tiny"] = bool(args.tiny)
    print(result["headline"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0 if result["passed"] else 1


def free(*_) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
