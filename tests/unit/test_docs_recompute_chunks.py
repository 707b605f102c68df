"""docs/memory.md said --recompute-chunks cuts the micro-batch at document boundaries, while the
code and --help require N to divide --micro-batch-size (chunks are groups of whole packs): the
doc's row now says what the code does, and the code refuses what the doc says it refuses."""
from __future__ import annotations

import os

import pytest

from train_args import parse, validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_docs_row_says_what_the_code_and_help_do(capsys):
    with open(os.path.join(ROOT, "docs", "memory.md"), encoding="utf-8") as f:
        row = next(line for line in f if line.startswith("| `--recompute-chunks N`"))
    assert "each a group of whole packs: N must divide `--micro-batch-size`" in row
    assert "document boundaries" not in row
    with pytest.raises(SystemExit):
        parse(["--help"])
    assert "Nmustdivide--micro-batch-size" in "".join(capsys.readouterr().out.split())  # wrapped at hyphens
    args = parse(["--data-path", "unused", "--recompute-granularity", "full", "--recompute-chunks", "3",
                  "--micro-batch-size", "2", "--global-batch-size", "2"])
    with pytest.raises(ValueError, match="--recompute-chunks 3 must divide --micro-batch-size 2"):
        validate(args, 1, check_files=False)
