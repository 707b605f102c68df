#!/usr/bin/env python3
"""The chunked linear + cross-entropy (core/loss.py) against full logits: peak memory at
Step-3.7-Flash's head, and time at a CPU-friendly size.

Memory, for a 128,896-token vocabulary, hidden 4096, bf16 hidden state and weight, T = 32768:

* ``full fp32 logits``: ``T x V x 4`` bytes, computed (16.9 GB), not allocated;
* ``F.cross_entropy on full logits``: what it holds for backward (fp32 log-probabilities,
  computed) and its forward + backward peak: on a GPU measured at T, on a CPU measured (peak
  RSS) at ``--full-tokens`` and scaled to T (every tensor it makes beyond the inputs and the
  gradients is ``[T, V]`` or ``[T, H]``, so its peak is linear in T);
* ``chunked``: what it holds for backward (the fp32 logsumexp) and its forward + backward peak,
  at T itself: every tensor the code makes is counted from the op that makes it until the last
  Python reference to it goes (``LiveBytes``), on the ``meta`` device (no storage, no compute:
  the accelerator's code path, bf16 GEMMs writing fp32) or on a GPU beside
  ``torch.cuda.max_memory_allocated``. On a CPU the same count runs on real tensors at
  ``--cpu-tokens`` next to the process's peak RSS (the CPU path: operands upcast to fp32), to
  show the count is what the allocator sees.

Peaks are above the inputs (h, W, labels) and shown with and without the gradients dh and dW
that every path returns (dW alone is V x H x 2 = 1.06 GB).

Time: forward + backward, median of ``--repeats``, at ``--time-shape`` (default T 2048, vocab
32768, hidden 1024), fp32 and bf16, chunked against ``F.cross_entropy(F.linear(h, W).float())``.

    python benchmarks/bench_loss.py [--tokens 32768] [--cpu-tokens 1024] [--full-tokens 512] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

V, H = 128896, 4096


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops inside the mode create, from the op that makes each until
    the last Python tensor on it is gone: ``peak`` and a timeline to recount the peak without
    some storages (the returned gradients). Views and in-place results share their storage;
    storages that existed before (the inputs) are never counted."""

    def __init__(self):
        super().__init__()
        self.refs: dict = {}      # storage key -> [bytes, live tensors, event index]
        self.tensors: dict = {}   # id -> weak reference, of the tensors counted
        self.events: list = []    # (+bytes or -bytes, storage key, allocation event index)
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {self._key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not self._counted(t):
                self._track(t, inputs)
        return out

    def _counted(self, t: torch.Tensor) -> bool:
        ref = self.tensors.get(id(t))
        return ref is not None and ref() is t

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _track(self, t: torch.Tensor, inputs: set) -> None:
        key = self._key(t)
        if key not in self.refs:
            if key in inputs:
                return  # a view or in-place result of a tensor from before
            nbytes = t.untyped_storage().nbytes()
            self.refs[key] = [nbytes, 0, len(self.events)]
            self.events.append((nbytes, key, len(self.events)))
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self.refs[key][1] += 1
        self.tensors[id(t)] = weakref.ref(t)
        weakref.finalize(t, self._release, key, id(t))

    def _release(self, key: int, ident: int) -> None:
        self.tensors.pop(ident, None)
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            self.events.append((-entry[0], key, entry[2]))
            del self.refs[key]

    def peak_without(self, *tensors) -> int:
        """The peak had the storages of ``tensors`` (alive now) never been allocated."""
        skip = {self.refs[self._key(t)][2] for t in tensors if self._key(t) in self.refs}
        now = peak = 0
        for nbytes, _, alloc in self.events:
            if alloc not in skip:
                now += nbytes
                peak = max(peak, now)
        return peak


def _inputs(T, V, H, dtype, device):
    g = torch.Generator().manual_seed(0)
    if device == "meta":
        h, w = torch.empty(T, H, dtype=dtype, device="meta"), torch.empty(V, H, dtype=dtype, device="meta")
        return h, w, torch.zeros(T, dtype=torch.long, device="meta")
    h = torch.randn(T, H, generator=g).to(dtype).to(device)
    w = (torch.randn(V, H, generator=g) * H ** -0.5).to(dtype).to(device)
    labels = torch.randint(0, V, (T,), generator=g).to(device)
    labels[::7] = -100
    return h, w, labels


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _rss_peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_peaks(device: str) -> int:
    """Reset the device's (or the process's) peak and return the bytes in use now."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    if device == "cpu":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return _rss_now()
    return 0


def _device_peak(device: str, base: int) -> int | None:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _rss_peak() - base if device == "cpu" else None


def measure_chunked(T: int, device: str) -> dict:
    """One forward and backward of the chunked passes (called directly: no autograd inside)."""
    from core.loss import chunked_backward, chunked_forward, tile_shape

    h, w, labels = _inputs(T, V, H, torch.bfloat16, device)
    rows, cols = tile_shape(T, V, H)
    grad = torch.ones((), device=device)
    base = _reset_peaks(device)
    with LiveBytes() as live:
        loss, lse = chunked_forward(h, w, labels, rows, cols)
        held = live.now  # what the forward leaves: the loss and the logsumexp
        dh, dw = chunked_backward(grad, h, w, labels, lse, rows, cols)
    grads = dh.numel() * dh.element_size() + dw.numel() * dw.element_size()
    return {"T": T, "device": device, "tile": [rows, cols], "held": held, "counted_peak": live.peak,
            "counted_peak_without_grads": live.peak_without(dh, dw), "grads": grads,
            "device_peak": _device_peak(device, base)}


def measure_full(T: int, device: str) -> dict:
    """``F.cross_entropy`` on full logits, forward and backward through autograd. The peak
    without the gradients is the one reached when the logits' gradient is ready (a hook on
    them): everything of size ``[T, V]`` has been made by then, and dh and dW not yet."""
    h, w, labels = _inputs(T, V, H, torch.bfloat16, device)
    h.requires_grad_(), w.requires_grad_()
    base = _reset_peaks(device)
    logits = F.linear(h, w)
    before_grads = []
    logits.register_hook(lambda g: before_grads.append(_device_peak(device, base)))
    loss = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")
    del logits
    held = (torch.cuda.memory_allocated() if device == "cuda" else _rss_now()) - base
    loss.backward()
    return {"T": T, "device": device, "held": held, "peak_without_grads": before_grads[0],
            "device_peak": _device_peak(device, base)}


def measure_time(T: int, V_: int, H_: int, dtype: str, device: str, repeats: int) -> dict:
    from core.loss import linear_cross_entropy

    h, w, labels = _inputs(T, V_, H_, getattr(torch, dtype), device)
    paths = {"chunked": lambda a, b: linear_cross_entropy(a, b, labels)[0],
             "full": lambda a, b: F.cross_entropy(F.linear(a, b).float(), labels, ignore_index=-100,
                                                  reduction="sum")}
    out = {}
    for name, fn in paths.items():
        times = []
        for i in range(repeats + 1):  # the first run warms up (not timed)
            a, b = h.detach().requires_grad_(), w.detach().requires_grad_()
            t0 = time.perf_counter()
            fn(a, b).backward()
            if device == "cuda":
                torch.cuda.synchronize()
            times += [time.perf_counter() - t0] if i else []
        out[name] = sorted(times)[len(times) // 2]
    return out


def _sub(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, *map(str, args)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gb(x) -> str:
    if x is None:
        return "-"
    return f"{x / 1e9:.2f}" if x >= 1e7 else f"{x / 1e9:.6f}"


def memory_table(args) -> float:
    T, fp32_logits = args.tokens, args.tokens * V * 4
    gpu = args.device == "cuda"
    chunked = _sub("--_chunked", T, "cuda" if gpu else "meta")
    full_T = T if gpu else args.full_tokens
    full = _sub("--_full", full_T, args.device)
    scale = T / full_T
    full_peak = full["peak_without_grads"] * scale
    how = "measured" if gpu else f"peak RSS at T={full_T} (held {_gb(full['held'])} GB), x{scale:g}"
    rows = [("full fp32 logits [T, V] (computed)", None, fp32_logits, None),
            ("F.cross_entropy on full logits", T * V * 4, full_peak, how),
            ("chunked (core/loss.py)", chunked["held"], chunked["counted_peak_without_grads"],
             f"tile {chunked['tile'][0]} x {chunked['tile'][1]}, counted on {chunked['device']}")]
    print(f"linear + cross-entropy, forward + backward: T={T}, vocab {V}, hidden {H}, bf16 h and W")
    print(f"{'path':<38}{'held GB':>10}{'peak GB':>9}{'/ fp32 logits':>15}  how")
    for name, held, peak, how in rows:
        print(f"{name:<38}{_gb(held):>10}{_gb(peak):>9}{peak / fp32_logits:>15.3f}  {how or ''}")
    print(f"peaks above the inputs, without dh and dW ({_gb(chunked['grads'])} GB, every path returns them); "
          f"chunked with them: {_gb(chunked['counted_peak'])} GB"
          + (f"; torch.cuda.max_memory_allocated: {_gb(chunked['device_peak'])} GB" if gpu else ""))
    print("how the chunked peak scales (counted on meta): dh's fp32 accumulator [T, H] plus a constant")
    print(f"{'T':>8}{'peak GB':>9}{'- T x H x 4 GB':>16}")
    for t in (4096, 8192, T, 2 * T):
        c = chunked if t == T else _sub("--_chunked", t, "meta")
        p = c["counted_peak_without_grads"]
        print(f"{t:>8}{_gb(p):>9}{_gb(p - t * H * 4):>16}")
    if not gpu and args.cpu_tokens:
        cpu = _sub("--_chunked", args.cpu_tokens, "cpu")
        print(f"the count against the allocator, chunked on this CPU at T={cpu['T']} (tile {cpu['tile'][0]} x "
              f"{cpu['tile'][1]}, operands upcast to fp32): counted {_gb(cpu['counted_peak'])} GB, peak RSS "
              f"{_gb(cpu['device_peak'])} GB (both with dh and dW)")
    ratio = chunked["counted_peak_without_grads"] / fp32_logits
    print(f"chunked peak / full fp32 logits = {ratio:.3f} ({'below' if ratio < 0.1 else 'NOT below'} 1/10)")
    return ratio


def time_table(args) -> None:
    T, V_, H_ = args.time_shape
    print(f"\ntime, forward + backward on {args.device}, T={T}, vocab {V_}, hidden {H_} "
          f"(median of {args.repeats})")
    print(f"{'dtype':<8}{'chunked s':>11}{'full logits s':>15}{'chunked / full':>16}")
    for dtype in ("float32", "bfloat16"):
        t = _sub("--_time", T, V_, H_, dtype, args.device, args.repeats)
        print(f"{dtype:<8}{t['chunked']:>11.3f}{t['full']:>15.3f}{t['chunked'] / t['full']:>15.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--cpu-tokens", type=int, default=1024, help="chunked on real CPU tensors (0: skip)")
    ap.add_argument("--full-tokens", type=int, default=512, help="full logits on a CPU, scaled to --tokens")
    ap.add_argument("--time-shape", type=int, nargs=3, default=[2048, 32768, 1024], metavar=("T", "V", "H"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--_chunked", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_full", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--_time", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._chunked:
        print(json.dumps(measure_chunked(int(args._chunked[0]), args._chunked[1])))
    elif args._full:
        print(json.dumps(measure_full(int(args._full[0]), args._full[1])))
    elif args._time:
        T, V_, H_, dtype, device, repeats = args._time
        print(json.dumps(measure_time(int(T), int(V_), int(H_), dtype, device, int(repeats))))
    else:
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        ratio = memory_table(args)
        time_table(args)
        print(f"\nreproduce: python benchmarks/bench_loss.py --tokens {args.tokens} --cpu-tokens {args.cpu_tokens} "
              f"--full-tokens {args.full_tokens} --time-shape {' '.join(map(str, args.time_shape))} "
              f"--device {args.device}")
        sys.exit(0 if ratio < 0.1 else 1)


if __name__ == "__main__":
    main()
