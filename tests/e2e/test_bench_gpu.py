"""benchmarks/bench_gpu.py --tiny on the CPU (so the GPU benchmark cannot rot), its refusal
without CUDA, the check it runs before timing, its FLOP count, and its run without transformers'
side of the family (the lent GPU's transformers has no step3p7)."""
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
        # ms/iter, tokens/s, TFLOP/s, then MFU, peak allocated and reserved ("-": no peak or allocator
        # on a CPU), the planner's figure, the speed
        assert re.search(rf"^{name} +{NUMBER} +{NUMBER} +{NUMBER} +- +- +- +{NUMBER} +{NUMBER}x$", out.stdout, re.M), \
            out.stdout
    assert "reproduce: python benchmarks/bench_gpu.py --tiny --seq-length 512" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("bench_gpu: CPU; check passed; ours ")
    res = json.loads(path.read_text())
    assert [r["name"] for r in res["rows"]] == ["ours (THD)", "transformers Step3p7"]
    for r in res["rows"]:
        assert r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(res["tokens"] / (r["ms"] / 1e3))
        assert r["tflops"] == pytest.approx(res["flops"] / (r["ms"] / 1e3) / 1e12)
    assert 1 < res["documents"] and res["tokens"] <= 512 and res["output_diff"]["max_rel"] < 0.1
    assert [c["what"] for c in res["compare"]] == [f"{n}: peak {k}" for n in ("ours (THD)", "transformers Step3p7")
                                                   for k in ("allocated", "reserved")]
    assert all(c["measured"] is None and c["planned"] > 0 for c in res["compare"])


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


def test_without_the_family_in_transformers_ours_is_still_timed(monkeypatch, tmp_path, capsys):
    """transformers 5.17 (the lent H200's) has no step3p7: the benchmark must not die on the
    import; it skips the check and transformers' row, says why, and times ours."""
    from benchmarks import bench_gpu, model_slice

    def fake_find_spec(name, *a):
        if name == "transformers.models.step3p7":
            return None
        return real(name, *a)

    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    import dataclasses

    def no_hf(cfg, device):
        raise ImportError("cannot import name 'Step3p7TextConfig' from 'transformers'")

    monkeypatch.setitem(model_slice.FAMILIES, "step37", dataclasses.replace(model_slice.FAMILIES["step37"], hf=no_hf))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # in process: leave pytest's threads
    path = tmp_path / "bench.json"
    rc = bench_gpu.main(["--tiny", "--seq-length", "128", "--iters", "1", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert re.search(r"^check skipped: transformers \S+ has no transformers\.models\.step3p7: transformers "
                     r"Step3p7 skipped; ours is timed alone", out, re.M), out
    res = json.loads(path.read_text())
    assert [r["name"] for r in res["rows"]] == ["ours (THD)"] and res["rows"][0]["ms"] > 0
    assert res["skipped"] and "step3p7" in res["skipped"][0]
    assert out.strip().splitlines()[-1].startswith("bench_gpu: CPU; check skipped (transformers ")
