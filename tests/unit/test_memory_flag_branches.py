"""The memory flags are branched on in the mode table (core/memory_mode.py) and hardly anywhere
else: the code reads what the table derives (``Placement``, ``RecomputePlacement``,
``MemoryMode``'s properties), not the raw flags.

What counts as a branch on a raw memory flag (``memory_flag_branches``): an attribute read
(``x.cpu_offload``, ``args.memory.bf16``, ``self.recompute``...) whose name is a field of the
memory section (``MemoryMode``: ``bf16``, ``data_parallel_sharding``, ``cpu_offload``...) or one of
the two short names the planner's inputs used to copy them under (``sharding``, ``recompute``),
anywhere inside the test of an ``if`` / ``elif`` / ``while``, of a conditional expression
(``a if test else b``), of a comprehension's ``if``, or among the operands of ``and`` / ``or``;
each such read counts once (``if m.bf16 and m.bf16_params`` is one). Every ``.py`` file of the
repository counts, except the mode table itself and tests/. Reads that only pass a value on
(``f(mode.cpu_offload)``) or compare outside a test (``x = a.bf16 == b``) do not count; nor do
names the table derives (``placement.host_masters``, ``rc.full``). 55 before the planner read
the table (37 of them in training/planner/)."""
from __future__ import annotations

import ast
import dataclasses
import os
from collections import Counter

from core.memory_mode import MemoryMode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = {f.name for f in dataclasses.fields(MemoryMode)} | {"sharding", "recompute"}
TABLE = os.path.join("core", "memory_mode.py")
MOST, MOST_PER_PLANNER_MODULE = 12, 3


def branch_reads(tree: ast.AST) -> int:
    """The memory-flag reads in the tests of ``tree`` (module docstring), each once."""
    tests = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.BoolOp):
            tests.extend(node.values)
    return len({id(n) for t in tests for n in ast.walk(t)
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.attr in NAMES})


def memory_flag_branches(root: str = ROOT) -> Counter:
    """Per file (relative path): the branches on raw memory flags it holds (module docstring)."""
    found: Counter = Counter()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("tests", "__pycache__", "build") and not d.startswith(".")
                         and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg")))  # a venv in the checkout
        for name in files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if name.endswith(".py") and rel != TABLE:
                n = branch_reads(ast.parse(open(path).read(), rel))
                if n:
                    found[rel] = n
    return found


def test_the_counter_counts_each_read_in_a_test_once():
    src = ("if a.bf16 and a.cpu_offload == 'x': pass\n"        # two
           "y = 1 if m.recompute == 'full' else 0\n"           # one (the planner's old short name)
           "z = [k for k in ks if k.bf16_params]\n"            # none: a derived name
           "w = f(mode.cpu_offload)\n"                         # none: passed on
           "v = p.host_masters or p.recompute_granularity\n")  # one
    assert branch_reads(ast.parse(src)) == 4


def test_branches_on_raw_memory_flags_stay_in_the_mode_table():
    found = memory_flag_branches()
    where = ", ".join(f"{path}: {n}" for path, n in found.most_common())
    assert sum(found.values()) <= MOST, f"{sum(found.values())} branches on raw memory flags ({where}): read " \
        "the mode's placement (core/memory_mode.py) instead"
    planner = {p: n for p, n in found.items() if p.startswith(os.path.join("training", "planner"))}
    assert all(n <= MOST_PER_PLANNER_MODULE for n in planner.values()), planner
