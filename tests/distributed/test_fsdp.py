"""FSDP2 (dense over DP, experts over expert-DP), with and without CPU offload and activation
recompute (whole micro-batches, or a pack at a time), gathering per micro-batch or once per step, AdamW and Muon: same losses and the same parameters after two optimizer steps as one
unsharded process (fp32, gloo); DeepSeek-V3 and GLM-4.5 over three steps. Tolerance 1e-5
relative per tensor."""
from __future__ import annotations

import pytest

from tests.distributed.fsdp_cases import check_fsdp

CASES = {  # name: (world, pp, ep, offload, recompute, optimizer)
    "dp2_adamw": (2, 1, 1, "none", "none", "adamw"),
    "dp2_muon_offload_recompute": (2, 1, 1, "all", "full", "muon"),
    "dp2_muon_selective": (2, 1, 1, "none", "selective", "muon"),
    "dp2_offload_experts_muon": (2, 1, 1, "experts", "none", "muon"),
    "pp2_ep2_adamw_offload_experts": (4, 2, 2, "experts", "none", "adamw"),
    "pp2_ep2_muon_recompute": (4, 2, 2, "none", "full", "muon"),
    "pp2_ep2_adamw_gather_once": (4, 2, 2, "none", "none", "adamw", True),
    "dp2_muon_gather_once_offload": (2, 1, 1, "all", "selective", "muon", True),
    "dp2_muon_offload_optimizer": (2, 1, 1, "optimizer", "full", "muon"),
    "pp2_ep2_adamw_offload_optimizer": (4, 2, 2, "optimizer", "none", "adamw"),
    # --recompute-chunks 2 on micro-batches of 2 packs: the experts sharded over DP (their reduce
    # held to the last chunk, sync off on the first micro-batch), gathered once, and under PP x EP
    "dp2_muon_chunks": (2, 1, 1, "none", "full", "muon", False, 2),
    "dp2_adamw_gather_once_chunks": (2, 1, 1, "none", "full", "adamw", True, 2),
    "pp2_ep2_muon_chunks": (4, 2, 2, "none", "full", "muon", False, 2),
    # the other families over three steps (then: family, overrides of its tiny preset, steps):
    # DeepSeek-V3 with a plain q_proj and non-interleaved rope (the tiny preset has q low-rank,
    # interleaved), GLM-4.5 with its MTP depth
    "dp2_muon_deepseek_v3_plain_q": (2, 1, 1, "none", "none", "muon", False, 1, "deepseek_v3",
                                     {"q_lora_rank": None, "rope_interleave": False}, 3),
    "dp2_adamw_glm4_moe": (2, 1, 1, "none", "none", "adamw", False, 1, "glm4_moe", None, 3),
}


# name -> (world, fn, args): the cases of one world size share one spawn (tests/distributed/conftest.py)
CASES = {name: (world, check_fsdp, rest) for name, (world, *rest) in CASES.items()}


@pytest.mark.parametrize("case", CASES)
def test_fsdp_matches_one_unsharded_process(shared_ranks, case):
    shared_ranks.check((__name__, case))
