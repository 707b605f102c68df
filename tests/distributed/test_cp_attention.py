"""Context-parallel attention on gloo at CP 2, 4 and 8 in fp64, against the unsharded layer:
full layers (all-gathered K/V) and sliding layers (halo of window - 1 keys, also when chunks are
shorter than the window so the halo spans several ranks), isolation between documents, and the
halo exchanges replayed under NCCL's rules. One spawn of 8 ranks runs every CP size (the first
N ranks form each CP group)."""
from __future__ import annotations

from tests.distributed.cp_cases import check_cp_attention
from tests.distributed.harness import run_ranks


def test_cp_attention_equals_the_unsharded_layer(tmp_path):
    run_ranks(8, check_cp_attention, tmpdir=str(tmp_path), timeout=180)
