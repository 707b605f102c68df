"""benchmarks/bench_gpu.py --tiny on the CPU (so the GPU benchmark cannot rot), its refusal
without CUDA, the check it runs before timing, its FLOP count, and the table that ends
tools/gpu_check.sh."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMBER = r"[0-9][0-9,.e+-]*"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    out = subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--tiny", "--json", str(path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    return out, path


def test_tiny_prints_both_rows_with_numbers(tiny_run):
    out, path = tiny_run
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.search(r"^check \(tiny preset layers \[1, 3\], fp32 on cpu, .*: passed$", out.stdout, re.M)
    for name in ("ours \\(THD\\)", "transformers Step3p7"):
        # ms/iter, tokens/s, TFLOP/s, then MFU and peak memory ("-": no peak or allocator on a CPU)
        assert re.search(rf"^{name} +{NUMBER} +{NUMBER} +{NUMBER} +- +- +{NUMBER}x$", out.stdout, re.M), out.stdout
    assert "reproduce: python benchmarks/bench_gpu.py --tiny --seq-length 512" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("bench_gpu: CPU; check passed; ours ")
    res = json.loads(path.read_text())
    assert [r["name"] for r in res["rows"]] == ["ours (THD)", "transformers Step3p7"]
    for r in res["rows"]:
        assert r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(res["tokens"] / (r["ms"] / 1e3))
        assert r["tflops"] == pytest.approx(res["flops"] / (r["ms"] / 1e3) / 1e12)
    assert 1 < res["documents"] and res["tokens"] <= 512 and res["output_diff"]["max_rel"] < 0.1


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the full benchmark would run")
def test_without_cuda_and_tiny_it_exits_2_saying_so():
    out = subprocess.run([sys.executable, "benchmarks/bench_gpu.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert "bench_gpu: needs a CUDA GPU (torch.cuda.is_available() is False here); --tiny runs" in out.stderr


def test_slice_flops_match_a_hand_count():
    from benchmarks.model_slice import slice_config, slice_flops
    from models.step37.config import Step37Config

    cfg, idx = slice_config(Step37Config.preset("tiny"))
    assert idx == [1, 3] and cfg.layer_types == ["sliding_attention", "full_attention"]
    # tiny: hidden 64, head_dim 16, 2 KV heads; sliding 6 heads, full 4; 8 experts of 32, top-2,
    # shared expert 32. Weights per token: sliding attention 64*(6*16 + 2*2*16 + 6) + 6*16*64 =
    # 16768, full 64*(4*16 + 2*2*16 + 4) + 4*16*64 = 12544, each MoE 64*8 + 2*3*64*32 + 3*64*32 =
    # 18944: 67200, times 6 = 403200 per token. One document of 10 tokens, window 8: a sliding
    # query sees 36 + 2*8 = 52 keys in all, a full one 55; 12*6*16 and 12*4*16 FLOPs per key.
    assert slice_flops(cfg, [10]) == 10 * 403200 + 1152 * 52 + 768 * 55


def test_check_fails_when_the_weights_are_mapped_wrong(monkeypatch):
    from benchmarks import model_slice as step37_slice

    torch.manual_seed(0)
    assert step37_slice.check_equivalence(torch.device("cpu"))["passed"]
    swapped = {"gate": "up", "up": "gate", None: None}
    half = step37_slice._half
    monkeypatch.setattr(step37_slice, "_half", lambda t, h: half(t, swapped[h]))
    res = step37_slice.check_equivalence(torch.device("cpu"))
    assert not res["passed"] and res["output"] > 100 * res["tolerance"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_cuda_paths" name="test_grouped_mm_in_bf16" time="1.5"/>
<testcase classname="tests.gpu.test_cuda_paths" name="test_compile[full]" time="40.2">{}</testcase>
<testcase classname="tests.gpu.test_cuda_paths" name="test_skipped" time="0.0"><skipped/></testcase>
</testsuite></testsuites>"""


@pytest.mark.parametrize("failure", ["", '<failure message="boom"/>'])
def test_gpu_check_table(tiny_run, tmp_path, failure):
    _, bench = tiny_run
    (tmp_path / "tests.xml").write_text(JUNIT.format(failure))
    out = subprocess.run([sys.executable, "tools/gpu_check_report.py", "--junit", str(tmp_path / "tests.xml"),
                          "--tests-rc", "1" if failure else "0", "--tests-seconds", "50", "--bench", str(bench),
                          "--bench-rc", "0", "--bench-seconds", "30"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == (1 if failure else 0), out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert re.search(r"^test_cuda_paths::test_grouped_mm_in_bf16 +passed +1\.5$", out.stdout, re.M)
    status = "failed" if failure else "passed"
    assert re.search(rf"^test_cuda_paths::test_compile\[full\] +{status} +40\.2$", out.stdout, re.M)
    assert re.search(r"^test_cuda_paths::test_skipped +skipped +0\.0$", out.stdout, re.M)
    assert re.search(r"^benchmarks/bench_gpu\.py +passed +30\.0$", out.stdout, re.M)
    assert any(l.startswith("ours (THD)") for l in lines) and any(l.startswith("transformers Step3p7") for l in lines)
    assert lines[-1] == f"gpu_check: {3 - bool(failure)} passed, {int(bool(failure))} failed, 1 skipped in 80 s"


def test_gpu_check_table_when_pytest_left_no_report(tmp_path):
    out = subprocess.run([sys.executable, "tools/gpu_check_report.py", "--junit", str(tmp_path / "none.xml"),
                          "--tests-rc", "124", "--tests-seconds", "300", "--bench", str(tmp_path / "none.json"),
                          "--bench-rc", "124", "--bench-seconds", "180"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert re.search(r"^tests/gpu +failed \(no JUnit report: FileNotFoundError\) +300\.0$", out.stdout, re.M)
    assert re.search(r"^benchmarks/bench_gpu\.py +failed \(timed out after 180 s\) +180\.0$", out.stdout, re.M)
    assert out.stdout.splitlines()[-1] == "gpu_check: 0 passed, 2 failed, 0 skipped in 480 s"
