#!/usr/bin/env python3
"""The table that ends ``tools/gpu_check.sh``: every GPU test (from pytest's JUnit XML) and the
benchmark run, each passed / failed / skipped with its seconds, then the benchmark's rows
(``benchmarks/bench_gpu.py --json``) and one summary line. Exits 1 if anything failed or a
report is missing, else 0.

    python tools/gpu_check_report.py --junit tests.xml --tests-rc 0 --tests-seconds 120 \\
        --bench bench.json --bench-rc 0 --bench-seconds 90
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TIMED_OUT = 124  # coreutils timeout's exit status


def test_results(path: str) -> list[tuple[str, str, float]]:
    """(test id, passed / failed / skipped, seconds) for each test case of a JUnit XML file."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        where = case.get("classname", "").removeprefix("tests.gpu.")
        status = ("failed" if case.find("failure") is not None or case.find("error") is not None
                  else "skipped" if case.find("skipped") is not None else "passed")
        rows.append((f"{where}::{case.get('name')}", status, float(case.get("time") or 0.0)))
    return rows


def _exit_status(rc: int, seconds: float) -> str:
    if rc == TIMED_OUT:
        return f"failed (timed out after {seconds:.0f} s)"
    return "passed" if rc == 0 else f"failed (exit {rc})"


def checks(args) -> list[tuple[str, str, float]]:
    """The tests' rows (or one failed row when pytest left no report or failed outside them)
    and the benchmark's."""
    rows = []
    try:
        rows = test_results(args.junit)
    except (OSError, ET.ParseError) as e:
        rows = [("tests/gpu", f"failed (no JUnit report: {e.__class__.__name__})", args.tests_seconds)]
    if args.tests_rc not in (0, 5) and not any(s.startswith("failed") for _, s, _ in rows):
        # 5: nothing collected; any other failure that no test case carries (a crash, a timeout)
        rows.append(("tests/gpu (pytest)", _exit_status(args.tests_rc, args.tests_seconds), args.tests_seconds))
    rows.append(("benchmarks/bench_gpu.py", _exit_status(args.bench_rc, args.bench_seconds), args.bench_seconds))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--junit", required=True, help="pytest --junitxml output of tests/gpu")
    ap.add_argument("--tests-rc", type=int, required=True, help="pytest's exit status")
    ap.add_argument("--tests-seconds", type=float, default=0.0)
    ap.add_argument("--bench", required=True, help="benchmarks/bench_gpu.py --json output")
    ap.add_argument("--bench-rc", type=int, required=True, help="bench_gpu.py's exit status")
    ap.add_argument("--bench-seconds", type=float, default=0.0)
    args = ap.parse_args(argv)

    rows = checks(args)
    w1, w2 = (max(len(r[i]) for r in rows) + 2 for i in (0, 1))
    print(f"\n{'check':<{w1}}{'result':<{w2}}{'seconds':>8}")
    for name, status, seconds in rows:
        print(f"{name:<{w1}}{status:<{w2}}{seconds:>8.1f}")
    try:
        with open(args.bench) as f:
            bench = json.load(f)
    except (OSError, ValueError):
        bench = None
    if bench and bench.get("rows"):
        from benchmarks.bench_gpu import format_table

        print(f"\nbenchmark: {bench['command']}")
        print("\n".join(format_table(bench)))
    failed = sum(s.startswith("failed") for _, s, _ in rows)
    passed = sum(s == "passed" for _, s, _ in rows)
    skipped = sum(s == "skipped" for _, s, _ in rows)
    total = args.tests_seconds + args.bench_seconds
    print(f"gpu_check: {passed} passed, {failed} failed, {skipped} skipped in {total:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
