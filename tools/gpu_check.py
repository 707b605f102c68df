#!/usr/bin/env python3
"""The GPU check's parts runner (``tools/gpu_check.sh`` calls it): each part a process of its own
under its own timeout, its result written the moment it ends, and one table at the end, so a part
that hangs is reported as hung and every other part still reports.

Per part: its output goes to the console (prefixed) and to ``OUT/<key>.log``; the part writes
``OUT/<key>.json`` (what it measured, a one-line ``headline``, what it ``skipped`` and why); one
line per finished part is appended to ``OUT/results.jsonl`` (key, name, status, seconds,
headline). A part still running at its timeout, or when the whole check's budget runs out, has
its process group killed and is ``hung``; a part with less than ``MIN_START`` seconds of budget
left is ``not run``. Exit: 0 when every part passed, 1 otherwise, 2 without CUDA (nothing run).

``GPU_CHECK_FAKE_PARTS`` (a JSON list of ``{"key", "name", "cmd", "timeout"}``) replaces the
parts and skips the CUDA check: how the CPU tests exercise the runner, timeouts included.

    python tools/gpu_check.py [--out DIR] [--model-preset PRESET] [--budget 450] [--only a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_START = 20.0   # seconds of budget a part needs to be started
BUDGET = 450.0     # the whole check, seconds: under 8 minutes with start-up and the table
KILL_GRACE = 5.0   # seconds between SIGTERM and SIGKILL of a timed-out part's process group
PY = sys.executable


@dataclass
class Part:
    key: str                 # short id: the table's first column, the log and JSON file names
    name: str                # what it checks
    cmd: list                # argv, run in the repository root; "{json}" becomes OUT/<key>.json
    timeout: float           # seconds
    results: dict = field(default_factory=dict)


def gpu_parts(preset: str | None, bench_args: list[str]) -> list[Part]:
    """The parts in the order they run: what is worth most first; (i), the CP attention (issue
    22's 128K recipe depends on it and it had never run on a GPU), and (h), the recipe's one-GPU
    proxy, before the runs (f) and (g) repeat what (a)-(c) already measured."""
    model = ["--model-preset", preset] if preset else []  # else the parts' own default full-width preset
    mod = lambda name: [PY, "-m", f"benchmarks.gpu_parts.{name}", *model, "--json", "{json}"]  # noqa: E731
    pytest = [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/gpu/test_cuda_paths.py", "-k"]
    return [
        Part("build", "the C++ extension, built in place for this Python", [PY, "tools/build_ext.py"], 120),
        Part("env", "versions and the GPU", [PY, "tools/gpu_check_env.py", "--json", "{json}"], 60),
        Part("a", "varlen vs sdpa in bf16, forward + backward", mod("attention"), 90),
        Part("b", "grouped_mm vs the per-expert loop, forward + backward", mod("experts"), 90),
        Part("c", "one MoE layer: syncs, time, MFU, peak memory", mod("moe_layer"), 90),
        Part("d", "head + MTP depths at T 8192: peak memory", mod("head"), 90),
        Part("e", "Newton-Schulz on one EP8 rank's expert stack", mod("newton_schulz"), 45),
        Part("i", "context-parallel attention: varlen with query != key boundaries; a 128K pack's CP4 shard",
             mod("cp_attention"), 90),
        Part("h", "one-GPU proxy of a recipe rank vs the planner", mod("proxy"), 150),
        Part("f1", "1-GPU --bf16 tiny training, eager", pytest + ["test_one_gpu_bf16_training_run"], 120),
        Part("f2", "1-GPU --bf16 tiny training, --compile", pytest + ["test_one_gpu_bf16_compiled_training_run"], 180),
        Part("g", "bench_gpu.py: two full-width layers, ours vs transformers",
             [PY, "benchmarks/bench_gpu.py", *model, "--json", "{json}", *bench_args], 150),
        Part("tests", "the other GPU tests (tests/gpu)",
             [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/gpu", "-k",
              "not test_one_gpu_bf16_training_run and not test_one_gpu_bf16_compiled_training_run"], 180),
    ]


def fake_parts(spec: str) -> list[Part]:
    return [Part(p["key"], p.get("name", p["key"]), p["cmd"], float(p["timeout"])) for p in json.loads(spec)]


def _pump(stream, key: str, log) -> None:
    for line in iter(stream.readline, ""):
        log.write(line)
        log.flush()
        sys.stdout.write(f"[{key}] {line}")
        sys.stdout.flush()


def _kill(proc) -> None:
    """SIGTERM to the part's process group, SIGKILL to whatever is left after KILL_GRACE."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(KILL_GRACE)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(0.1 if proc.poll() is not None else 0)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_part(part: Part, out: str, left: float) -> dict:
    """Run one part under ``min(its timeout, left)``; its result (also appended to results.jsonl)."""
    timeout = min(part.timeout, left)
    row = {"key": part.key, "name": part.name, "seconds": 0.0, "headline": ""}
    if left < MIN_START:
        row["status"] = f"not run ({left:.0f} s of the budget left)"
        return _record(out, row)
    json_path = os.path.join(out, f"{part.key}.json")
    if os.path.exists(json_path):  # an earlier check's result must not stand in for this one's
        os.remove(json_path)
    cmd = [c.replace("{json}", json_path) for c in part.cmd]
    start = time.monotonic()
    with open(os.path.join(out, f"{part.key}.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        pump = threading.Thread(target=_pump, args=(proc.stdout, part.key, log), daemon=True)
        pump.start()
        try:
            rc = proc.wait(timeout)
            row["status"] = "passed" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            row["status"] = f"hung (killed after {timeout:.0f} s)"
        _kill(proc)  # a hung part, or what a finished one left running (it may hold the GPU)
        pump.join(KILL_GRACE)
    row["seconds"] = time.monotonic() - start
    result = _read_json(json_path)
    row["headline"] = result.get("headline") or _last_line(os.path.join(out, f"{part.key}.log"))
    row["skipped"] = result.get("skipped", [])
    return _record(out, row)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _last_line(path: str) -> str:
    try:
        with open(path) as f:
            lines = [l.strip() for l in f if l.strip()]
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


def _record(out: str, row: dict) -> dict:
    with open(os.path.join(out, "results.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"gpu_check: [{row['key']}] {row['name']}: {row['status']} in {row['seconds']:.1f} s"
          + (f": {row['headline']}" if row["headline"] else ""), flush=True)
    return row


def table(rows: list[dict]) -> str:
    w = max(len(r["key"]) for r in rows) + 2
    ws = max(len(r["status"]) for r in rows) + 2
    lines = [f"{'part':<{w}}{'result':<{ws}}{'seconds':>8}  what / measured"]
    for r in rows:
        lines.append(f"{r['key']:<{w}}{r['status']:<{ws}}{r['seconds']:>8.1f}  {r['name']}")
        if r["headline"]:
            lines.append(f"{'':<{w + ws + 8}}  {r['headline']}")
        for s in r.get("skipped", []):
            lines.append(f"{'':<{w + ws + 8}}  skipped: {s}")
    passed = sum(r["status"] == "passed" for r in rows)
    lines.append(f"gpu_check: {passed} passed, {len(rows) - passed} failed in {sum(r['seconds'] for r in rows):.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check"), help="logs, JSON results and "
                    "results.jsonl go here (default runs/gpu_check)")
    ap.add_argument("--model-preset", help="a registered full-width preset for the model-specific parts (default: "
                    "the parts' own, benchmarks/gpu_parts/common.py)")
    ap.add_argument("--budget", type=float, default=BUDGET, help=f"seconds for every part together ({BUDGET:g})")
    ap.add_argument("--only", help="comma-separated part keys to run (default: all)")
    ap.add_argument("--bench-args", default="", help="extra flags for bench_gpu.py, e.g. '--compile'")
    args = ap.parse_args(argv)
    fake = os.environ.get("GPU_CHECK_FAKE_PARTS")
    if not fake:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing run", file=sys.stderr)
            return 2
    parts = fake_parts(fake) if fake else gpu_parts(args.model_preset, args.bench_args.split())
    if args.only:
        keep = set(args.only.split(","))
        parts = [p for p in parts if p.key in keep]
    os.makedirs(args.out, exist_ok=True)
    open(os.path.join(args.out, "results.jsonl"), "w").close()
    deadline = time.monotonic() + args.budget
    rows = [run_part(p, args.out, deadline - time.monotonic()) for p in parts]
    print("\n" + table(rows))
    return 0 if all(r["status"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
