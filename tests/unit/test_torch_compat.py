"""What differs across the torch and Python releases we support (torch >= 2.11, Python 3.10-3.12;
the lent H200 runs torch 2.11 on Python 3.12, CI torch 2.13 on 3.11) is feature-detected, not
assumed: FSDP2's parameter groups (one optional group in 2.11, a list since per-parameter
meshes), and every source file parses as Python 3.10."""
from __future__ import annotations

import ast
import os
from types import SimpleNamespace

from core.distributed.fsdp_internals import fsdp_param_groups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fsdp_param_groups_of_either_torch():
    g = object()
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=g)) == [g]          # torch 2.11
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
    assert fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=[g, g])) == [g, g]  # torch >= 2.12


def test_every_source_file_parses_as_python_3_10():
    bad = []
    for top in ("core", "models", "training", "data", "tools", "benchmarks", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    try:
                        ast.parse(open(path).read(), path, feature_version=(3, 10))
                    except SyntaxError as e:
                        bad.append(f"{os.path.relpath(path, ROOT)}:{e.lineno}: {e.msg}")
    for name in ("pretrain_step37.py", "train_args.py", "setup.py"):
        ast.parse(open(os.path.join(ROOT, name)).read(), name, feature_version=(3, 10))
    assert not bad, bad
