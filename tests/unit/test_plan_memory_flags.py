"""tools/plan_memory.py's own size flags: --device-gb 0, -5, nan or inf was accepted and planned
against ("does NOT fit nan GB", exit 0); now a one-line usage error naming the flag, exit 2. So is
--world-size 0 (--search listed no layout and said none fits)."""
from __future__ import annotations

import pytest

from tools.plan_memory import main


@pytest.mark.parametrize("flags, message", [
    (["--device-gb", "0"], "--device-gb must be a finite number > 0, got 0"),
    (["--device-gb", "-5"], "--device-gb must be a finite number > 0, got -5"),
    (["--device-gb", "nan"], "--device-gb must be a finite number > 0, got nan"),
    (["--device-gb", "inf", "--search"], "--device-gb must be a finite number > 0, got inf"),
    (["--host-gb", "nan", "--search"], "--host-gb must be a finite number >= 0 (0: no limit), got nan"),
    (["--host-gb", "-1"], "--host-gb must be a finite number >= 0 (0: no limit), got -1"),
    # the search listed no layout of 0 ranks and called it "no layout fits"
    (["--world-size", "0", "--search"], "--world-size must be >= 1, got 0"),
    (["--world-size=-8"], "--world-size must be >= 1, got -8"),
])
def test_device_and_host_gb_must_be_finite_and_positive(flags, message, capsys):
    assert main(["--world-size", "2", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"plan_memory.py: error: {message}\n" and captured.out == ""


def test_a_finite_device_gb_still_plans(capsys):
    assert main(["--world-size", "2", "--device-gb", "80"]) == 0
    assert "80 GB" in capsys.readouterr().out
