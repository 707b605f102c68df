#!/usr/bin/env python3
"""The GPU check's parts runner (``tools/gpu_check.sh`` calls it): each part a process of its own
under its own timeout, inside one wall-clock budget, and three files at the end, so a lent
machine that returns few files returns all of it.

``--out DIR`` receives exactly three files: ``results.json`` (every part: status, seconds, the
time it needed, its headline, what it skipped, what it measured and the planner's prediction
beside each, ``compare``; rewritten as each part ends), ``summary.txt`` (the table the console
ends with) and ``logs.tar.gz`` (each part's log and JSON). The parts' own files are written to a
temporary directory outside ``DIR``.

The budget (``--budget``, default 9 minutes of wall clock, counted from when ``gpu_check.sh``
started) is shared by all parts, which run in the order of what they decide. A part starts only
when the budget still holds its timeout, the kill grace after it and the finish (archive, table);
otherwise it is ``not run: budget`` and the next, smaller part may still fit. A part still
running at its timeout has its process group killed and is ``hung``. Exit: 0 when every part
passed, 1 otherwise, 2 without CUDA or with an ``--out`` it cannot use (nothing run). ``--out``
is refused, in one line, when it holds files the check did not write (a rerun replaces only its
own three) or nothing can be written there.

``GPU_CHECK_FAKE_PARTS`` (a JSON list of ``{"key", "name", "cmd", "timeout"}``) replaces the
parts and skips the CUDA check: how the CPU tests exercise the runner, timeouts included.

    python tools/gpu_check.py [--out DIR] [--model-preset PRESET] [--budget 540] [--only a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: core/ (stdlib only here, nothing built yet)
    sys.path.insert(0, ROOT)

from core.cli import POSITIVE, checked  # noqa: E402
BUDGET = 540.0     # the whole check, seconds of wall clock: 9 of the lease's 15 minutes
KILL_GRACE = 5.0   # seconds between SIGTERM and SIGKILL of a timed-out part's process group
FINISH = 10.0      # seconds kept for the archive, results.json, summary.txt and the table
LOG_CAP = 4 << 20  # bytes of one part's log kept in the archive (the rest is counted, not kept)
NOT_RUN = "not run: budget"
FILES = ("results.json", "summary.txt", "logs.tar.gz")
PY = sys.executable


@dataclass
class Part:
    key: str                 # short id: the table's first column, the log and JSON file names
    name: str                # what it checks
    cmd: list                # argv, run in the repository root; "{json}" becomes <work>/<key>.json
    timeout: float           # seconds it may take: the time it needs before it is started
    results: dict = field(default_factory=dict)

    @property
    def need(self) -> float:
        return self.timeout + KILL_GRACE


def gpu_parts(preset: str | None, bench_args: list[str]) -> list[Part]:
    """The parts in the order of what they decide: build and environment; correctness (the CUDA
    tests of the newest features, the compiled one apart, then a and b, then the older CUDA tests); then the timings
    (c, j, d, e, the two recipe proxies h and h100, i, f1, f2, g). docs/performance.md says which
    part answers which prediction."""
    model = ["--model-preset", preset] if preset else []  # else the parts' own default full-width preset

    def mod(name, *more):
        return [PY, "-m", f"benchmarks.gpu_parts.{name}", *model, *more, "--json", "{json}"]

    pytest = [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests/gpu/test_cuda_paths.py", "-k"]
    return [
        Part("build", "the C++ extension, built in place for this Python", [PY, "tools/build_ext.py"], 60),
        Part("env", "versions and the GPU", [PY, "tools/gpu_check_env.py", "--json", "{json}"], 20),
        Part("t1", "CUDA tests of the newest features: chunked recompute with offloaded inputs, the in-backward "
             "side stream, host masters, offloaded runs", pytest + [NEWEST], 150),
        Part("t1c", "CUDA test of compiled layers with varlen against eager, without recompiles (inductor's "
             "compilation is most of it)", pytest + [COMPILED], 120),
        Part("a", "varlen vs sdpa in bf16, forward + backward", mod("attention"), 45),
        Part("b", "grouped_mm vs the per-expert loop, forward + backward", mod("experts"), 45),
        Part("t2", "the older CUDA tests: varlen, grouped_mm, fp32 layers, the chunked loss at small shapes",
             pytest + [f"not ({NEWEST}) and not {COMPILED} and not {TRAINING}"], 60),
        Part("c", "one MoE layer: syncs, time, MFU, peak memory vs the planner", mod("moe_layer"), 45),
        Part("j", "EP2 all-to-all with and without --overlap-moe-expert-parallel-comm, two ranks on the one GPU "
             "over gloo: step, exposed all-to-all vs the planner",
             [PY, "-m", "benchmarks.gpu_parts.moe_overlap", "--json", "{json}"], 90),  # its own model
        Part("d", "head + MTP depths at T 8192: peak memory vs the planner", mod("head"), 60),
        Part("e", "Newton-Schulz on one EP8 rank's expert stack", mod("newton_schulz"), 30),
        Part("h", "one-GPU proxy of the 8 x H200 recipe's rank vs the planner", mod("proxy"), 150),
        Part("h100", "one-GPU proxy of the 8 x H100 recipe's rank (--recompute-chunks 4 --offload-recompute-inputs) "
             "vs the planner", mod("proxy", "--recipe", "8xh100"), 150),
        Part("i", "context-parallel attention: varlen with query != key boundaries; a 128K pack's CP4 shard",
             mod("cp_attention"), 60),
        Part("f1", "1-GPU --bf16 tiny training, eager", pytest + ["test_one_gpu_bf16_training_run"], 60),
        Part("f2", "1-GPU --bf16 tiny training, --compile", pytest + ["test_one_gpu_bf16_compiled_training_run"], 120),
        Part("g", "bench_gpu.py: two full-width layers, ours vs transformers",
             [PY, "benchmarks/bench_gpu.py", *model, "--json", "{json}", *bench_args], 120),
    ]


# pytest -k expressions: the newest features' CUDA tests (t1, t1c) and the two training runs f1, f2
NEWEST = "offloaded_inputs or own_stream or offloaded_training_run or host_masters"
COMPILED = "compiled_layers_with_varlen"
TRAINING = "(test_one_gpu_bf16_training_run or test_one_gpu_bf16_compiled_training_run)"


def fake_parts(spec: str) -> list[Part]:
    return [Part(p["key"], p.get("name", p["key"]), p["cmd"], float(p["timeout"])) for p in json.loads(spec)]


def _pump(stream, key: str, log) -> None:
    kept = dropped = 0
    for line in iter(stream.readline, ""):
        if kept + len(line) <= LOG_CAP:
            log.write(line)
            log.flush()
            kept += len(line)
        else:
            dropped += len(line)
        sys.stdout.write(f"[{key}] {line}")
        sys.stdout.flush()
    if dropped:
        log.write(f"\n[gpu_check: {dropped} more characters of output not kept: LOG_CAP {LOG_CAP}]\n")


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


def not_run(part: Part, left: float) -> dict:
    return {"key": part.key, "name": part.name, "status": NOT_RUN, "seconds": 0.0, "need_s": part.need,
            "headline": f"needs {part.need:.0f} s, {max(left, 0):.0f} s of the budget left", "skipped": [],
            "compare": [], "result": {}}


def run_part(part: Part, work: str, left: float) -> dict:
    """Run one part if ``left`` (seconds of the budget, the finish already kept back) holds what it
    needs; its row either way. Its log and JSON go to ``work``."""
    if left < part.need:
        return _announce(not_run(part, left))
    row = {"key": part.key, "name": part.name, "seconds": 0.0, "need_s": part.need, "headline": ""}
    json_path = os.path.join(work, f"{part.key}.json")
    if os.path.exists(json_path):  # an earlier check's result must not stand in for this one's
        os.remove(json_path)
    log_path = os.path.join(work, f"{part.key}.log")
    cmd = [c.replace("{json}", json_path) for c in part.cmd]
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        pump = threading.Thread(target=_pump, args=(proc.stdout, part.key, log), daemon=True)
        pump.start()
        try:
            rc = proc.wait(part.timeout)
            row["status"] = "passed" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            row["status"] = f"hung (killed after {part.timeout:.0f} s)"
        except BaseException:  # the check itself is being stopped: the part goes with it
            row["status"] = "stopped (the check was interrupted)"
            _kill(proc)
            pump.join(KILL_GRACE)
            row["seconds"] = time.monotonic() - start
            raise _Stopped(_finish_row(row, json_path, log_path))
        _kill(proc)  # a hung part, or what a finished one left running (it may hold the GPU)
        pump.join(KILL_GRACE)
    row["seconds"] = time.monotonic() - start
    return _announce(_finish_row(row, json_path, log_path))


class _Stopped(Exception):
    def __init__(self, row: dict):
        super().__init__(row["key"])
        self.row = row


def _finish_row(row: dict, json_path: str, log_path: str) -> dict:
    result = _read_json(json_path)
    row["headline"] = result.get("headline") or _last_line(log_path)
    row["skipped"] = result.get("skipped", [])
    row["compare"] = result.get("compare", [])
    row["result"] = result
    return row


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else {}
    except (OSError, ValueError):
        return {}


def _last_line(path: str) -> str:
    try:
        with open(path) as f:
            lines = [l.strip() for l in f if l.strip()]
    except OSError:
        return ""
    return lines[-1][:160] if lines else ""


def _announce(row: dict) -> dict:
    print(f"gpu_check: [{row['key']}] {row['name']}: {row['status']} in {row['seconds']:.1f} s"
          + (f": {row['headline']}" if row["headline"] else ""), flush=True)
    return row


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def table(rows: list[dict], budget: float, elapsed: float) -> str:
    w = max(len("part"), *(len(r["key"]) for r in rows)) + 2
    ws = max(len("result"), *(len(r["status"]) for r in rows)) + 2
    pad = " " * (w + ws + 10)
    lines = [f"{'part':<{w}}{'result':<{ws}}{'seconds':>8}  what / measured"]
    for r in rows:
        lines.append(f"{r['key']:<{w}}{r['status']:<{ws}}{r['seconds']:>8.1f}  {r['name']}")
        if r["headline"]:
            lines.append(f"{pad}{r['headline']}")
        for c in r.get("compare", []):
            lines.append(f"{pad}{c.get('what', '?')}: measured {_fmt(c.get('measured'))}, planned "
                         f"{_fmt(c.get('planned'))}" + (f" {c['unit']}" if c.get("unit") else ""))
        for s in r.get("skipped", []):
            lines.append(f"{pad}skipped: {s}")
    count = lambda p: sum(p(r["status"]) for r in rows)  # noqa: E731
    lines.append(f"gpu_check: {count(lambda s: s == 'passed')} passed, {count(lambda s: s.startswith('failed'))} "
                 f"failed, {count(lambda s: s.startswith(('hung', 'stopped')))} hung, {count(lambda s: s == NOT_RUN)} "
                 f"not run in {elapsed:.0f} s of a {budget:.0f} s budget")
    return "\n".join(lines)


def write_results(out: str, rows: list[dict], pending: list[Part], budget: float, elapsed: float) -> None:
    """results.json, replaced whole (a reader never sees half of it): the finished parts and the
    ones still waiting."""
    doc = {"budget_s": budget, "elapsed_s": elapsed, "files": list(FILES),
           "parts": rows + [{"key": p.key, "name": p.name, "status": "pending", "seconds": 0.0, "need_s": p.need}
                            for p in pending]}
    tmp = os.path.join(out, ".results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, os.path.join(out, "results.json"))


def archive(out: str, work: str) -> None:
    tmp = os.path.join(out, ".logs.tar.gz.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for name in sorted(os.listdir(work)):
            tar.add(os.path.join(work, name), arcname=f"gpu_check/{name}")
    os.replace(tmp, os.path.join(out, "logs.tar.gz"))


def _deadline(budget: float) -> float:
    """The budget's end on the monotonic clock, counted from ``GPU_CHECK_T0`` (the epoch second
    gpu_check.sh started, before its CUDA probe) when set, else from now."""
    try:
        spent = max(0.0, time.time() - float(os.environ["GPU_CHECK_T0"]))
    except (KeyError, ValueError):
        spent = 0.0
    return time.monotonic() + budget - spent


def _stop(signum, frame):
    """SIGTERM (the lease's own timeout): stop the running part, then write the three files."""
    raise KeyboardInterrupt


def run_all(parts: list[Part], out: str, budget: float) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    deadline = _deadline(budget)
    begin = deadline - budget
    work = tempfile.mkdtemp(prefix="gpu_check_")
    rows: list[dict] = []
    old = signal.signal(signal.SIGTERM, _stop)
    try:
        for i, p in enumerate(parts):
            write_results(out, rows, parts[i:], budget, time.monotonic() - begin)
            rows.append(run_part(p, work, deadline - FINISH - time.monotonic()))
    except _Stopped as e:
        rows.append(e.row)
        rows += [not_run(p, 0) for p in parts[len(rows):]]
    except KeyboardInterrupt:
        rows += [not_run(p, 0) for p in parts[len(rows):]]
    finally:
        signal.signal(signal.SIGTERM, old)
        elapsed = time.monotonic() - begin
        summary = table(rows, budget, elapsed) if rows else "gpu_check: no part"
        archive(out, work)
        write_results(out, rows, [], budget, elapsed)
        with open(os.path.join(out, "summary.txt"), "w") as f:
            f.write(summary + "\n")
        shutil.rmtree(work, ignore_errors=True)
        print("\n" + summary, flush=True)
    return rows


def out_problem(out: str) -> str:
    """Why ``--out`` cannot take the three files, in one line ("" when it can): a file in the way,
    a folder where nothing can be written, or one holding files the check did not write (never
    deleted: a rerun replaces only its own three; ``core/checkpoint/out_dir.py``)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from core.checkpoint.out_dir import check_out_dir

    try:
        check_out_dir(out, FILES + (".results.json.tmp", ".logs.tar.gz.tmp"), flag="--out", tool="gpu_check",
                      overwrite=None)
    except ValueError as e:
        return str(e)
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_check"),
                    help=f"the three files {', '.join(FILES)} go here (default runs/gpu_check)")
    ap.add_argument("--model-preset", help="a registered full-width preset for the model-specific parts (default: "
                    "the parts' own, benchmarks/gpu_parts/common.py)")
    ap.add_argument("--budget", type=checked(float, POSITIVE), default=BUDGET,
                    help=f"seconds of wall clock for the whole check, from gpu_check.sh's start, a finite "
                         f"number > 0 ({BUDGET:g})")
    ap.add_argument("--only", help="comma-separated part keys to run (default: all)")
    ap.add_argument("--bench-args", default="", help="extra flags for bench_gpu.py, e.g. '--compile'")
    args = ap.parse_args(argv)
    why = out_problem(args.out)
    if why:
        print(f"gpu_check: error: {why}", file=sys.stderr)
        return 2
    fake = os.environ.get("GPU_CHECK_FAKE_PARTS")
    if not fake:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing run", file=sys.stderr)
            return 2
    parts = fake_parts(fake) if fake else gpu_parts(args.model_preset, args.bench_args.split())
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {p.key for p in parts}
        if unknown:
            ap.error(f"--only: no part {', '.join(sorted(unknown))} (parts: {', '.join(p.key for p in parts)})")
        parts = [p for p in parts if p.key in keep]
    rows = run_all(parts, args.out, args.budget)
    return 0 if all(r["status"] == "passed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
