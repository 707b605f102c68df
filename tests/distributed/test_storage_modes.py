"""--store-param-remainders, --optimizer-in-backward and --cpu-offload masters against --bf16 (fp32
masters): one rank and EP2 x DP2 with FSDP, AdamW and Muon (momentum 0), the same batches; each
resumes bitwise from checkpoint files, and so does --overlap-moe-expert-parallel-comm at EP2
(Muon with momentum 0.9).

Tolerances, relative to how far each tensor moved in the steps compared:
- --optimizer-in-backward alone, clipping off: bitwise (the same gradient, the same update,
  only earlier); clipping on: momentum-free Muon ignores the clip factor, so its matrices differ
  only by Newton-Schulz's fp32 rounding of a scaled input (measured 1.6e-5 after a step, 1e-3
  allowed; in bf16 an input one rounding apart moves the update by 2e-2, hence fp32 here);
- --store-param-remainders: the masters are exact and updated in fp32 (tests/unit/test_masters.py
  shows the same gradients give the same masters bit for bit), but the compute value of a master
  sitting exactly halfway between two bf16 values rounds away from zero where --bf16's rounds to
  even (no 16-bit remainder can round to even exactly): a few of 414K weights compute one bf16
  ulp apart from step 1 (measured: the first loss 7e-6 relative apart), and at DP > 1 the reduced
  gradients are rounded to bf16 once. Muon's update is discontinuous in such noise (Newton-Schulz
  lifts near-zero singular values toward 1), so only the losses are compared for it (measured
  2e-5 after 4 steps; 1e-3 allowed); AdamW (eps 1: smooth) masters measured within 2.7% of their
  movement after a step, 10% allowed;
- --cpu-offload masters: fp32 masters on the host, their bf16 rounding (to even, as --bf16's
  cast) on the device, the same fp32 updates: bitwise at one rank; at DP 2 its sharded bf16
  parameters' reduced gradients are rounded to bf16 once (as with remainders).
"""
from __future__ import annotations

import pytest

from tests.distributed.harness import CASE_DIR
from tests.distributed.masters_cases import compare_modes, resume_is_bitwise

LAYOUTS = {"one_rank": (1, 1), "ep2_dp2_fsdp": (4, 2)}
REMAINDERS = {"adamw": (0.10, 1e-3), "muon": (float("inf"), 1e-3)}


def _follows(layout, optimizer):
    world, ep = LAYOUTS[layout]
    steps = 4 if optimizer == "muon" else 1
    bf16_grads = REMAINDERS[optimizer] if world > 1 else (0.0, 0.0)  # host masters: exact at one rank
    tol = {"in_backward": (0.0, 0.0), "remainders": REMAINDERS[optimizer], "both": REMAINDERS[optimizer],
           "host": bf16_grads, "host_in_backward": bf16_grads}
    return world, compare_modes, (ep, optimizer, 0.0, steps, tol)


RESUMES = [("remainders", 1), ("in_backward", 1), ("both", 4), ("host_in_backward", 4)]
# name -> (world, fn, args): the cases of one world size share one spawn (tests/distributed/conftest.py)
CASES = {f"{layout}-{optimizer}": _follows(layout, optimizer) for layout in LAYOUTS for optimizer in REMAINDERS}
CASES["clip"] = (1, compare_modes, (1, "muon", 1.0, 1, {
    "in_backward": (1e-3, 0.0), "remainders": (float("inf"), 1e-3), "both": (float("inf"), 1e-3),
    "host": (0.0, 0.0), "host_in_backward": (1e-3, 0.0)}))
# micro-batches of 2 packs, a fully recomputed block run a pack at a time (core/transformer/chunked.py),
# alone and with host masters stepping in the backward. In bf16 the chunks' GEMMs have other shapes
# and round some activations one bf16 ulp apart from the whole micro-batch's (the first loss
# measured 1.5e-5 relative apart; in fp32 tests/unit/test_recompute_chunks.py finds the gradients
# equal within 4e-6), and a token's top-k choice may flip on such an ulp: AdamW's masters after a
# step measured within 1.5% of their movement (7.1% at EP2 x DP2), 30% allowed (a chunk's gradient
# lost or counted twice moves them by 50-100%, measured 129%); Muon is discontinuous in such noise (see above), so only its
# losses are compared: measured 3.2e-4 after 4 steps, 1e-3 allowed
CHUNK_TOL = {"adamw": (0.3, 1e-4), "muon": (float("inf"), 1e-3)}
CASES.update({f"chunks-{layout}-{opt}": (LAYOUTS[layout][0], compare_modes,
                                         (LAYOUTS[layout][1], opt, 0.0, 4 if opt == "muon" else 1,
                                          dict.fromkeys(("chunks", "host_in_backward_chunks"), CHUNK_TOL[opt]),
                                          ("bf16", "chunks", "host_in_backward_chunks"), 2))
              # AdamW at one rank, Muon at EP2 x DP2 (the recipe's combination); FSDP's accumulation in
              # fp32 against one process: tests/distributed/test_fsdp.py
              for layout, opt in (("one_rank", "adamw"), ("ep2_dp2_fsdp", "muon"))})
CASES.update({f"resume-{mode}-{world}": (world, resume_is_bitwise, (2 if world == 4 else 1, mode, "muon", CASE_DIR))
              for mode, world in RESUMES})
# --overlap-moe-expert-parallel-comm at EP2 (its schedule's numbers against the plain one's:
# tests/distributed/test_moe_overlap_layouts.py): saved at step 2 through checkpoint files, Muon
# with momentum (its buffers and AdamW's moments resumed), the same masters and losses bitwise
CASES["resume-overlap-2"] = (2, resume_is_bitwise, (2, "overlap", "muon", CASE_DIR, 0.9))


@pytest.mark.parametrize("case", [k for k in CASES if k != "clip" and not k.startswith(("resume-", "chunks-"))])
def test_each_mode_follows_bf16(shared_ranks, case):
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", [k for k in CASES if k.startswith("chunks-")])
def test_chunked_recompute_follows_bf16(shared_ranks, case):
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", ["clip"])
def test_clipping_cannot_change_momentum_free_muon(shared_ranks, case):
    """The global clip factor is known only after the backward; Muon steps in it unclipped."""
    shared_ranks.check((__name__, case))


@pytest.mark.parametrize("case", [k for k in CASES if k.startswith("resume-")])
def test_resume_is_bitwise(shared_ranks, case):
    """The checkpoint holds fp32 masters: loading splits them into the same bf16 values and
    remainders (one rank; and EP2 x DP2, whose shards are DTensors)."""
    shared_ranks.check((__name__, case))
