"""The Step-3.7 VLM under FSDP2 (full recompute) with images on one data-parallel rank only,
and over two pipeline stages: the same losses and parameters after two steps as one unsharded
process (fp32, gloo; tolerances in tests/distributed/vlm_cases.py); at EP2 with images on one
rank, --overlap-moe-expert-parallel-comm gives the plain schedule's losses over three steps."""
from __future__ import annotations

import pytest

from tests.distributed.vlm_cases import check_vlm, check_vlm_overlap

CASES = {"dp2_fsdp_images_on_one_rank": (2, check_vlm, ("fsdp",)),
         "pp2_images_on_the_first_stage": (2, check_vlm, ("pp",)),
         "ep2_overlap_images_on_one_rank": (2, check_vlm_overlap, ())}


@pytest.mark.parametrize("case", CASES)
def test_vlm_fsdp_matches_one_process(shared_ranks, case):
    shared_ranks.check((__name__, case))
