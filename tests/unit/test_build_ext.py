"""tools/build_ext.py, what gpu_check.sh runs first on a machine with another Python (the lent
H200's 3.12): one compiler call that needs no pybind11 package (torch ships its headers), named
for this interpreter; the module it builds plans packs as the installed one does."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig

import numpy as np

from tools import build_ext


def test_the_extension_builds_with_torchs_headers_alone(tmp_path, monkeypatch):
    import torch

    monkeypatch.setitem(sys.modules, "pybind11", None)  # the lent machine may have no pybind11
    out = str(tmp_path / ("_csrc" + sysconfig.get_config_var("EXT_SUFFIX")))
    cmd = build_ext.compile_command(out, opt="-O0")  # -O0: a few seconds on the 2-core CI
    assert f"-I{os.path.join(os.path.dirname(torch.__file__), 'include')}" in cmd
    subprocess.run(cmd, check=True, cwd=build_ext.ROOT)
    assert build_ext.up_to_date(out)
    spec = importlib.util.spec_from_loader("data._csrc", importlib.machinery.ExtensionFileLoader("data._csrc", out))
    built = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(built)
    from data import _csrc

    lengths = np.array([5, 17, 3, 30, 12, 8, 1], dtype=np.int64)
    for a, b in zip(built.plan_packs(lengths, 32, 0, 7), _csrc.plan_packs(lengths, 32, 0, 7)):
        assert np.array_equal(np.asarray(a), np.asarray(b)) if not isinstance(a, dict) else a == b
    assert np.array_equal(built.permutation(10, 3), _csrc.permutation(10, 3))
    assert build_ext.target().endswith(sysconfig.get_config_var("EXT_SUFFIX"))
