"""Evaluation's forward-only pipeline on every layout of the equivalence tests: the validation
loss equals one process's within 1e-5 relative (same terms, another summation order)."""
from __future__ import annotations

import pytest

from tests.distributed.eval_cases import check_eval_layout
from tests.distributed.harness import run_ranks
from tests.distributed.test_parallel_equivalence import LAYOUTS


@pytest.mark.parametrize("name", LAYOUTS)
def test_validation_loss_matches_one_process(tmp_path, name):
    world, pp, vpp, ep = LAYOUTS[name]
    run_ranks(world, check_eval_layout, pp, vpp, ep, tmpdir=str(tmp_path))
