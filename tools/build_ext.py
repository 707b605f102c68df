#!/usr/bin/env python3
"""Build the C++ extension ``data/_csrc`` in place, for this interpreter, without installing
anything: what ``tools/gpu_check.sh`` runs first on a machine whose image we do not control (the
lent H200: Python 3.12, no package registry; the ``.so`` carried from a 3.11 machine does not
load there).

One compiler call, with the flags ``setup.py`` uses (C++17, -O3, hidden symbols): pybind11's
headers from the ``pybind11`` package where it is installed, else the copy every torch wheel
ships in ``torch/include``; Python's own headers; the output named with this interpreter's
extension suffix. Nothing is done when the extension is newer than its sources.

    python tools/build_ext.py [--force]
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["csrc/pack_planner.cpp"]


def pybind11_include() -> str:
    """pybind11's headers: the package's, else torch's bundled copy."""
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        import torch

        return os.path.join(os.path.dirname(torch.__file__), "include")


def target(root: str = ROOT) -> str:
    return os.path.join(root, "data", "_csrc" + sysconfig.get_config_var("EXT_SUFFIX"))


def compile_command(out: str, root: str = ROOT, opt: str = "-O3") -> list[str]:
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    return [*cxx, opt, "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden", "-DNDEBUG",
            f"-I{pybind11_include()}", f"-I{sysconfig.get_paths()['include']}",
            *(os.path.join(root, s) for s in SOURCES), "-o", out]


def up_to_date(out: str, root: str = ROOT) -> bool:
    return os.path.exists(out) and all(os.path.getmtime(out) >= os.path.getmtime(os.path.join(root, s))
                                       for s in SOURCES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild even when the extension is up to date")
    args = ap.parse_args(argv)
    out = target()
    if not args.force and up_to_date(out):
        print(f"build_ext: {os.path.relpath(out, ROOT)} is up to date")
        return 0
    cmd = compile_command(out)
    print("build_ext: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    try:
        rc = subprocess.run(cmd, cwd=ROOT).returncode
    except FileNotFoundError as e:
        print(f"build_ext: no C++ compiler ({e.filename}); set CXX", file=sys.stderr)
        return 1
    if rc == 0:
        print(f"build_ext: built {os.path.relpath(out, ROOT)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
