"""Multi-rank cases that share spawns (harness.SharedRanks): a test asking for the fixture
``shared_ranks`` and parametrized over ``case`` names an entry of its module's ``CASES``
(``name -> (world, fn, args)``) and calls ``shared_ranks.check((__name__, case))``. Every such test is put in the xdist group of its world size, so
that under ``--dist loadgroup`` (the Makefile's) one worker runs all cases of a size in one spawn."""
from __future__ import annotations

import pytest

from tests.distributed.harness import SharedRanks


def _key(item):
    if "shared_ranks" not in getattr(item, "fixturenames", ()) or not hasattr(item, "callspec"):
        return None
    return item.module.__name__, item.callspec.params["case"]


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        key = _key(item)
        if key is not None:
            world = item.module.CASES[key[1]][0]
            item.add_marker(pytest.mark.xdist_group(f"ranks{world}"))


@pytest.fixture(scope="session")
def shared_ranks(request, tmp_path_factory) -> SharedRanks:
    cases = {}
    for item in request.session.items:  # the selected tests (after -k, deselection)
        key = _key(item)
        if key is not None:
            cases[key] = item.module.CASES[key[1]]
    return SharedRanks(str(tmp_path_factory.mktemp("shared_ranks")), cases)

