"""Context-parallel attention on gloo at CP 2, 4 and 8 in fp64, against the unsharded layer:
full layers (all-gathered K/V) and sliding layers (halo of window - 1 keys, also when chunks are
shorter than the window so the halo spans several ranks), isolation between documents, and the
halo exchanges replayed under NCCL's rules. One spawn of 8 ranks runs every CP size (the first
N ranks form each CP group), in the spawn of the other 8-rank cases (tests/distributed/conftest.py)."""
from __future__ import annotations

import pytest

from tests.distributed.cp_cases import check_cp_attention

CASES = {"cp2_cp4_cp8": (8, check_cp_attention, ())}


@pytest.mark.parametrize("case", CASES)
def test_cp_attention_equals_the_unsharded_layer(shared_ranks, case):
    shared_ranks.check((__name__, case))
