"""The GPU check's parts (benchmarks/gpu_parts) run their own code on the CPU at tiny width
(``--tiny``), so a part cannot rot between the rare runs on a GPU; what only a GPU shows (flash,
syncs, peak memory, MFU) is left out there."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu_parts import attention, cp_attention, experts, head, moe_layer, newton_schulz
from tests.unit.test_varlen_adapter import reference_varlen_attn, use_kernel


def _run(module, tmp_path, *flags):
    path = tmp_path / "part.json"
    rc = module.main(["--tiny", "--json", str(path), *flags])
    return rc, json.loads(path.read_text())


def test_attention_compares_both_kernels_with_fp32(monkeypatch):
    """Part (a)'s comparison with the documented contract of varlen_attn standing in for flash."""
    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
               enable_gqa=False):
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                     window_size=window_size, enable_gqa=enable_gqa, calls=[])

    use_kernel(monkeypatch, kernel)
    layout = attention.layout_of((40, 9, 3, 12), torch.device("cpu"))
    r = attention.compare(4, 2, 16, 8, layout, torch.device("cpu"), time_it=False)
    assert r["passed"], r
    assert set(r["varlen"]) == set(attention.NAMES) and 0 < r["varlen"]["dq"] < 0.05
    assert attention.shapes_of("step37-flash") == [(96, 8, 128, 512), (96, 8, 128, None), (64, 8, 128, 512),
                                                   (64, 8, 128, None)]


def test_cp_attention_part_runs_on_the_cpu(tmp_path):
    """Part (i) with sdpa standing in for flash: the simulated exchange and the code's plans give
    the unsharded layer's output, and the long pack's key buffer is the planner's."""
    rc, r = _run(cp_attention, tmp_path)
    assert rc == 0 and r["passed"], r
    assert [(row["heads"], row["window"]) for row in r["rows"]] == [(6, 8), (6, None), (4, 8), (4, None)]
    assert all(row["ref_vs_unsharded"] < 1e-5 for row in r["rows"])
    # documents of 37, 20, 9, 3 padded to 40, 24, 16, 8: rank 0 holds chunks 0 and 7 of each,
    # 5 + 3 + 2 + 1 rows twice; full: prefixes 5 + 40, 3 + 24, 2 + 16, 1 + 8 keys
    full = r["rows"][1]
    assert (full["queries"], full["segments"], full["key_rows"]) == (22, 8, 99)
    assert [c["what"] for c in r["compare"]] == [f"CP4 shard of 512 tokens fwd+bwd{k}" for k in
                                                 ("", ": peak allocated", ": peak reserved")]
    long = r["long"]  # one document of 512 tokens: (1 + 1/8) x 512 key rows
    assert long["queries"] == 128 and long["key_rows"] == long["key_rows_predicted"] == 576 and long["finite"]


def test_cp_attention_varlen_call_with_torch_2_11_keywords(monkeypatch):
    """Part (i)'s comparison through the CP varlen call, with torch 2.11's signature (no
    enable_gqa: passing it raises TypeError) and the documented bottom-right contract standing in
    for flash: query and key boundaries differ, GQA goes to the kernel as it is."""
    calls = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
               page_table=None, seqused_k=None):  # torch 2.11's keywords
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                     window_size=window_size, calls=calls)

    use_kernel(monkeypatch, kernel)
    shards = cp_attention.shards_of(cp_attention.TINY_LENGTHS)
    for window in (8, None):
        r = cp_attention.compare(6, 2, 16, window, shards, torch.device("cpu"))
        assert r["passed"] and 0 < r["varlen"]["dk"] < 0.05, r
        call = calls[-1]
        assert call["cu"].tolist() != call["cu_k"].tolist() and call["window"] == ((7, 0) if window else (-1, 0))
        assert call["max_k"] == (40 if window is None else 12)  # chunk 7 of 40 sees the whole document


def test_experts_part_finds_empty_experts_and_compares(tmp_path):
    rc, r = _run(experts, tmp_path)
    assert rc == 0 and r["passed"], r
    assert [row["experts"] for row in r["rows"]] == [8, 2] and all(row["empty"] >= 1 for row in r["rows"])
    assert all(row["empty_grads_zero"] for row in r["rows"])


def test_experts_full_width_cases_are_the_recipes():
    assert experts.cases("step37-flash", False) == [(288, 4096, 1280, 8192 * 8), (36, 4096, 1280, 4 * 8192 * 8)]


def test_moe_layer_part_reads_nothing_back(tmp_path):
    rc, r = _run(moe_layer, tmp_path)
    assert rc == 0 and r["host_reads"] == [] and r["ms"] > 0 and r["tflops"] > 0, r
    # no allocator on the CPU: the peaks are None, the planner's figure is there, above the
    # weights and gradients it holds (fp32 on the CPU: 4 bytes each)
    assert [(c["what"], c["measured"]) for c in r["compare"]] == [
        ("one MoE layer fwd+bwd MFU", None), ("one MoE layer fwd+bwd: peak allocated", None),
        ("one MoE layer fwd+bwd: peak reserved", None)]
    assert r["compare"][0]["planned"] == 0.4  # the planner's assumed MFU (no peak on the CPU: none measured)
    assert r["compare"][1]["planned"] == r["planned_gib"] > 2 * 4 * r["parameters"] / 2**30


def test_head_part_measures_both_recompute_modes(tmp_path):
    rc, r = _run(head, tmp_path)
    assert rc == 0 and [row["recompute"] for row in r["rows"]] == ["none", "full"]
    none, full = r["rows"]
    assert none["mtp_depths"] == 2 and 0 < full["predicted_gib"] < none["predicted_gib"]
    for row in r["rows"]:  # the planner's peak: its activations on top of the weights and gradients held
        assert row["planned_peak_gib"] == pytest.approx(row["predicted_gib"] + row["params_gib"] + row["grads_gib"])
        assert row["peak_allocated_gib"] is None and row["peak_reserved_gib"] is None
    assert len(r["compare"]) == 4 and r["compare"][1]["what"] == "head + MTP, recompute none: peak reserved"


def test_newton_schulz_part_times_an_ep_rank_stack(tmp_path):
    rc, r = _run(newton_schulz, tmp_path)
    assert rc == 0 and r["shape"] == [2, 32, 64] and r["planned_ms"] > 0
    assert r["compare"] == [{"what": "Newton-Schulz [2, 32, 64]", "measured": r["ms"], "planned": r["planned_ms"],
                             "unit": "ms"}]
    # the planner's count for one [36, 1280, 4096] stack, 5 steps: 36 * 5 * (4 m^2 n + 2 m^3)
    m, n = 1280, 4096
    assert newton_schulz.planned_flops((36, m, n), 5) == pytest.approx(36 * 5 * (4 * m * m * n + 2 * m ** 3))


def test_moe_overlap_part_sums_the_compute_streams_stalls_by_call(monkeypatch):
    """Part (j)'s exposed all-to-all on CUDA (bench_moe_overlap.StallRecord): an event pair on the
    current stream around each all-to-all call, the pairs' elapsed times summed by call (fake
    events on a counter's clock, a second a tick, stand in for CUDA's); on the CPU the host's
    seconds. The part itself runs at its --tiny size on two ranks in
    tests/distributed/test_moe_overlap_layouts.py (gpu_part_j_tiny)."""
    from benchmarks.bench_moe_overlap import StallRecord

    clock = iter(range(100))

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.t = next(clock)

        def elapsed_time(self, end):
            return 1e3 * (end.t - self.t)  # milliseconds, as CUDA's

    monkeypatch.setattr(torch.cuda, "Event", Event)
    rec = StallRecord(cuda=True)
    rec.timed("L0.", "start", lambda: None)         # ticks 0, 1: issued, the stream not held
    rec.timed("L0.", "wait", lambda: next(clock))   # 2, (3 inside), 4: the stream held 2 ticks
    rec.timed("L1.", "wait", lambda: None)          # 5, 6
    assert rec.exposed() == {"start": 1.0, "wait": 3.0}
    assert rec.events == [("L0.", "start"), ("L0.", "wait"), ("L1.", "wait")]
    assert set(rec.blocked_s) == {"start", "wait"}  # the host's seconds kept too
    rec.reset()
    assert rec.exposed() == {} and rec.events == [] and rec.blocked_s == {}
    host = StallRecord(cuda=False)
    host.timed("L0.", "counts", lambda: None)
    assert host.exposed() == host.blocked_s and host.pairs == [] and next(clock) == 7  # no event on the CPU


def test_moe_overlap_part_plans_its_full_size_at_the_measured_rates():
    """Part (j)'s planner prediction at the size it runs on the GPU (an 8192-token pack, beyond
    the tiny preset's 4096 positions, which validate refused), --bf16: the compute is the given
    seconds (the plain step's), the bandwidth the measured one, and the overlap hides."""
    from benchmarks.gpu_parts import common, moe_overlap

    args = common.parse("", [], moe_overlap._extra)
    moe_overlap.sizes(args)
    assert (args.seq, args.expert_size) == (8192, 8192)
    p = moe_overlap.predict(args, 2, True, 3e9, 0.4)
    assert p["plain"]["compute"] == pytest.approx(0.4) and p["overlap"]["compute"] == pytest.approx(0.4)
    assert p["assumed_gb_s"] == 3.0 and 0 < p["overlap"]["exposed"] < p["plain"]["exposed"]
    assert p["overlap"]["step"] < p["plain"]["step"]
