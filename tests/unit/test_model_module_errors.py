"""--model-module: a module that does not import is a one-line error naming it; a syntax error
names the module's file and line (no traceback); a module that raises while it is imported is
named, with where in its file."""
from __future__ import annotations

import sys

import pytest

from models import registry
from train_args import parse


@pytest.fixture
def modules(tmp_path, monkeypatch):
    (tmp_path / "broken_syntax_family.py").write_text("import os\n\ndef register(:\n    pass\n")
    (tmp_path / "raising_family.py").write_text("X = 1\nraise RuntimeError('no GPU found')\n")
    (tmp_path / "bad_import_family.py").write_text("import not_a_module_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("broken_syntax_family", "raising_family", "bad_import_family"):
        sys.modules.pop(name, None)


def test_each_failure_is_one_line_naming_the_module(modules):
    cases = [
        ("broken_syntax_family", f"--model-module 'broken_syntax_family': "
                                 f"{modules / 'broken_syntax_family.py'}, line 3: SyntaxError: "),
        ("raising_family", f"--model-module 'raising_family' raised RuntimeError while it was "
                           f"imported, at {modules / 'raising_family.py'}, line 2: no GPU found"),
        ("bad_import_family", "--model-module 'bad_import_family': cannot import it (No module named "
                              "'not_a_module_anywhere_xyz')"),
        ("no_such_family_xyz", "--model-module 'no_such_family_xyz': cannot import it (No module "
                               "named 'no_such_family_xyz')"),
    ]
    for name, message in cases:
        with pytest.raises(ValueError) as e:
            registry.import_model_module(name)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
        assert e.value.__cause__ is None and e.value.__suppress_context__


def test_the_trainer_flag_reports_it_as_a_usage_error(modules, capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--data-path", "unused", "--model-module", "broken_syntax_family"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{modules / 'broken_syntax_family.py'}, line 3: SyntaxError" in err and "Traceback" not in err


def test_a_family_registered_first_does_not_hide_the_built_in_ones(monkeypatch):
    """An out-of-tree family imported before any lookup (tests/fake_family.py imported by a test
    module) registers into an empty registry: the built-in families still load beside it."""
    from tests.fake_family import SPEC

    monkeypatch.setattr(registry, "_SPECS", {})
    registry.register(SPEC)
    assert {"fake_dense", "step37", "qwen3_moe", "deepseek_v3"} <= set(registry.families())
    assert registry.spec_for_preset("deepseek-v3-tiny").family == "deepseek_v3"
