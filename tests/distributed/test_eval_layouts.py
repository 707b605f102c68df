"""Evaluation's forward-only pipeline on every layout of the equivalence tests: the validation
loss equals one process's within 1e-5 relative (same terms, another summation order)."""
from __future__ import annotations

import pytest

from tests.distributed.eval_cases import check_eval_layout
from tests.distributed.test_parallel_equivalence import LAYOUTS

# in the spawns of the equivalence tests' layouts (tests/distributed/conftest.py)
CASES = {name: (world, check_eval_layout, (pp, vpp, ep)) for name, (world, pp, vpp, ep) in LAYOUTS.items()}


@pytest.mark.parametrize("case", LAYOUTS)
def test_validation_loss_matches_one_process(shared_ranks, case):
    shared_ranks.check((__name__, case))
