"""--profile on the CPU: the shared Muon run (tests/e2e/conftest.py, ``--profile
--profile-step-start 2 --profile-step-end 3``) writes one Chrome trace that ``json.load`` reads,
holding iteration 3 and its operators, and nothing of the iterations outside the window."""
from __future__ import annotations

import json
import os

from tests.e2e.conftest import PROFILE


def test_profile_writes_a_chrome_trace_of_the_chosen_iterations(muon8):
    assert PROFILE == ["--profile", "--profile-step-start", "2", "--profile-step-end", "3"]
    folder = muon8.log_dir / "profile"
    assert sorted(os.listdir(folder)) == ["trace_rank0.json"]  # no memory snapshot without CUDA
    with open(folder / "trace_rank0.json") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("iteration ")]
    assert [e["name"] for e in steps] == ["iteration 3"]
    step = steps[0]
    inside = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("aten::")
              and step["ts"] <= e["ts"] and e["ts"] + e.get("dur", 0) <= step["ts"] + step["dur"]]
    names = {e["name"] for e in inside}
    assert {"aten::mm", "aten::add_"} <= names, sorted(names)[:40]  # the forward's GEMMs, the update
    assert len(muon8) == 8
