"""--bf16: bf16 compute over fp32 master weights, fp32 gradient accumulation and reduction.
Updates too small for bf16 still move the weights, checkpoints hold fp32, losses track fp32
without being equal to them, layouts (CP among them) match one --bf16 process, and resume is exact."""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from tests.e2e.test_training import train

ADAMW = ["--optimizer", "adamw", "--lr", "5e-3"]


def _losses(rows):
    return [r["loss"] for r in rows]


def test_small_updates_move_fp32_masters_and_checkpoints_hold_them(dataset, tmp_path):
    """AdamW at lr 1e-5 with weight decay 0.1: each step moves a weight by ~1e-5, below bf16's
    resolution at the init scale (0.02 x 2^-8 = 8e-5), so a bf16 weight would not move at all."""
    from core.checkpoint.sharded import load_checkpoint
    from models.step37 import Step37Config, Step37Model

    train(["--data-path", dataset, "--bf16", "--optimizer", "adamw", "--lr", "1e-5", "--weight-decay", "0.1",
           "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--train-iters", "3",
           "--save", str(tmp_path / "ck")], tmp_path / "tb")
    path = tmp_path / "ck" / "iter_0000003"
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = {k: m for k, m in saved.items() if k.startswith("model/")}
    assert weights and all(m.properties.dtype == torch.float32 for m in weights.values())
    before = Step37Model(Step37Config.preset("tiny"), seed=7)  # the run's --seed
    after = Step37Model(Step37Config.preset("tiny"), seed=99)
    load_checkpoint(str(path), [after])
    start = dict(before.named_parameters())
    checked = 0
    for name, p in after.named_parameters():
        if p.dim() >= 2 and "embed" not in name:  # projections, experts, heads (the embedding
            moved = (p != start[name]).float().mean().item()  # only moves the rows it saw)
            assert moved > 0.95, f"{name}: only {100 * moved:.1f}% of the entries moved"
            checked += 1
    assert checked > 20


def test_bf16_tracks_fp32_but_is_not_fp32(dataset, tmp_path):
    args = ["--data-path", dataset, *ADAMW, "--train-iters", "20"]
    fp32 = _losses(train(args, tmp_path / "fp32"))
    bf16 = _losses(train(args + ["--bf16"], tmp_path / "bf16"))
    assert len(fp32) == len(bf16) == 20
    assert fp32 != bf16  # something ran in bf16
    worst = max(abs(a - b) / a for a, b in zip(fp32, bf16))
    assert worst <= 0.03, f"bf16 loss differs from fp32 by {100 * worst:.2f}%"


def test_bf16_layouts_match_one_bf16_process(dataset, tmp_path):
    """PP2 x EP2, PP2 x FSDP DP2 and CP2 x EP2 (the EP group is the CP group) under --bf16
    against one --bf16 process, 3 steps; every run pads documents to 4 (what CP2 pads to), so
    all plan the same packs. The first step's loss agrees to fp32 rounding (measured: bitwise;
    the same bf16 copies of the same fp32 weights, losses summed in fp64: 1e-6 allows a
    reordered fp32 sum), except at CP2, whose attention runs over other key sets in bf16 (a
    chunk against its prefix instead of the whole document): 1e-3 there. Later steps differ
    because gradients are summed in another order (fp32, ~1e-7 relative), and a master weight
    that lands on the other side of a bf16 rounding boundary changes its compute copy by one bf16
    ulp (3.9e-3 relative): measured at most 1e-4 relative over 3 steps, so 1e-3 leaves 10x margin
    and still fails when a layout drops or doubles a micro-batch (>= 5% here). Over more steps a
    token's top-k choice can flip on such a difference, a discrete change (seen: 2.5e-3 at step
    5), which is why the comparison stops at 3."""
    args = ["--data-path", dataset, *ADAMW, "--train-iters", "3", "--bf16", "--document-pad-multiple", "4"]
    one = _losses(train(args, tmp_path / "one"))
    layouts = {"pp2_ep2": (4, 1e-6, ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
               "pp2_fsdp_dp2": (4, 1e-6, ["--pipeline-model-parallel-size", "2", "--data-parallel-sharding", "fsdp"]),
               "cp2_ep2": (2, 1e-3, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2"])}
    for name, (world, first_tol, flags) in layouts.items():
        got = _losses(train(args + flags, tmp_path / name, world=world))
        worst = max(abs(a - b) / a for a, b in zip(one, got))
        first = abs(got[0] - one[0]) / one[0]
        assert len(got) == 3 and first <= first_tol and worst <= 1e-3, f"{name}: {worst:.2e} ({one} vs {got})"


def test_bf16_resume_is_bitwise_and_checkpoints_cross_precisions(dataset, adamw4, tmp_path):
    """The runs saved from: the shared ones of tests/e2e/conftest.py (these flags, checkpoints at
    2 and 4), read only."""
    args = ["--data-path", dataset, *ADAMW, "--train-iters", "4", "--bf16"]
    full, ck = adamw4(True)
    start = str(ck / "iter_0000002")
    resumed = train(args + ["--load", start], tmp_path / "b")
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert _losses(resumed) == _losses(full[2:])  # exactly
    fp32 = train(["--data-path", dataset, *ADAMW, "--train-iters", "4", "--load", start], tmp_path / "c")
    assert [r["iteration"] for r in fp32] == [3, 4]
    assert all(abs(a - b) <= 0.03 * a for a, b in zip(_losses(full[2:]), _losses(fp32)))
    # and an fp32 checkpoint resumes under --bf16
    back = train(args + ["--load", str(adamw4(False)[1] / "iter_0000002")], tmp_path / "e")
    assert [r["iteration"] for r in back] == [3, 4] and os.path.exists(tmp_path / "e" / "metrics.jsonl")


def test_host_masters_match_one_process_at_dp2_and_pp2_ep2(dataset, tmp_path):
    """--cpu-offload masters (fp32 masters and AdamW state on the host, Muon's matrices stepping
    in the backward) at DP2 and at PP2 x EP2 against one such process taking both packs in one
    micro-batch, 3 steps; tolerance as for the --bf16 layouts above (1e-3), the first step too:
    on the CPU bf16 attention runs in query blocks over the micro-batch (core/transformer/
    sdpa_blocks.py), so one process's two-pack micro-batch sums each document's keys in other
    blocks than a rank's one pack (measured 8.6e-5 relative at DP2; the fp32 weights and their
    bf16 copies are the same)."""
    common = ["--data-path", dataset, "--train-iters", "3", "--bf16", "--cpu-offload", "masters",
              "--optimizer", "muon", "--muon-momentum", "0", "--lr", "0.01", "--adamw-lr", "1e-3",
              "--optimizer-in-backward", "--global-batch-size", "2", "--data-parallel-sharding", "fsdp"]
    one = _losses(train(common + ["--micro-batch-size", "2"], tmp_path / "one"))
    for name, world, flags in (("dp2", 2, []), ("pp2_ep2", 4, ["--pipeline-model-parallel-size", "2",
                                                                 "--expert-model-parallel-size", "2"])):
        got = _losses(train(common + flags, tmp_path / name, world=world))
        worst = max(abs(a - b) / a for a, b in zip(one, got))
        assert len(got) == 3 and worst <= 1e-3, (name, one, got)
