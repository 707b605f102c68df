"""core/ is model-agnostic: no identifier, attribute or string outside docstrings names a
model's parameters, modules or private methods. The model declares what core needs
(core/model_api.py) instead."""
from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORBIDDEN = ("embed_tokens", "lm_head", "moe.experts", "num_mtp_layers", "_aux_loss", "last_stats")
FORBIDDEN_ATTRIBUTES = {"mtp", "layers", "config"}  # a model's submodules and config, reached into


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def violations(source: str, path: str) -> list[str]:
    """Each model name in an identifier, an attribute, an import or a string (docstrings aside)."""
    tree = ast.parse(source, path)
    docstrings = _docstring_nodes(tree)
    found = []
    for node in ast.walk(tree):
        texts = []
        if isinstance(node, ast.Name):
            texts.append(node.id)
        elif isinstance(node, ast.Attribute):
            texts.append(node.attr)
            if node.attr in FORBIDDEN_ATTRIBUTES:
                found.append(f"{path}:{node.lineno}: attribute .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            texts.append(node.value)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg)):
            texts.append(getattr(node, "name", None) or node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):  # core's own modules may be named so
            modules = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(m.split(".")[0] == "models" for m in modules):
                found.append(f"{path}:{node.lineno}: imports a model package")
        for text in texts:
            for word in FORBIDDEN:
                if word in text:
                    found.append(f"{path}:{getattr(node, 'lineno', '?')}: {word!r} in {text!r}")
    return found


def test_core_names_no_model():
    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "core")):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found += violations(open(path).read(), os.path.relpath(path, ROOT))
    assert not found, "core/ names model internals:\n" + "\n".join(found)


def test_the_check_finds_what_the_first_wave_had():
    """The checker itself: each way core used to reach into the model is caught."""
    samples = {
        'EXPERT = ".moe.experts."': "moe.experts",
        "shared = chunk.config.num_mtp_layers > 0": "num_mtp_layers",
        "aux = model._aux_loss()": "_aux_loss",
        "x = model.mtp is not None": ".mtp",
        "blocks = list(chunk.layers.values())": ".layers",
        'import re\nR = re.compile(r"(embed_tokens|lm_head)")': "embed_tokens",
        "from models.step37 import Step37Model": "model package",
    }
    for code, what in samples.items():
        assert any(what in v for v in violations(code, "sample.py")), code
    assert violations('"""Docstrings may say embed_tokens and lm_head."""\nx = 1', "ok.py") == []


# ---------------------------------------------------------------- layering and family names
FAMILY_WORDS = re.compile(r"step37|step3p|qwen", re.IGNORECASE)
ALLOWED_WORDS = re.compile(r"pretrain_step37|step37-trainer")  # the entry script's and the project's name
# every top-level package and module, lowest first: each may import only those listed before it
# (tools and benchmarks, the command lines and measurements, stand above the rest)
STACK = ("core", "models", "data", "training", "train_args", "pretrain_step37", "tools", "benchmarks")
LAYERS = {  # package -> packages it must not import (shared/DESIGN.md)
    "core": ("models", "training", "data", "train_args", "pretrain_step37", "tools", "benchmarks", "tests"),
    "models": ("training", "train_args", "data", "pretrain_step37", "tools", "benchmarks", "tests"),
    "data": ("models", "training", "train_args", "pretrain_step37", "tools", "benchmarks", "tests"),
    "training": ("train_args", "pretrain_step37", "tools", "benchmarks", "tests"),
    "train_args.py": ("pretrain_step37", "tools", "benchmarks", "tests"),
    "pretrain_step37.py": ("tools", "benchmarks", "tests"),
    "tools": ("benchmarks", "tests"),
}
NO_FAMILY = ["core", "training", "data", "tools", "models/common", "train_args.py", "pretrain_step37.py"]


def _python_files(where: str) -> list[str]:
    path = os.path.join(ROOT, where)
    if path.endswith(".py"):
        return [path]
    return sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files if f.endswith(".py"))


def layering_violations(source: str, path: str, forbidden: tuple) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in modules:
                if m.split(".")[0] in forbidden:
                    found.append(f"{path}:{node.lineno}: imports {m}")
    return found


def family_names(source: str, path: str) -> list[str]:
    """Each line that names a model family outside a docstring (comments and strings count)."""
    tree = ast.parse(source, path)
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                skip |= set(range(body[0].lineno, body[0].end_lineno + 1))
    return [f"{path}:{i}: {line.strip()}" for i, line in enumerate(source.splitlines(), 1)
            if i not in skip and FAMILY_WORDS.search(ALLOWED_WORDS.sub("", line))]


def test_packages_import_only_the_layers_below_them():
    found = []
    for package, forbidden in LAYERS.items():
        for path in _python_files(package):
            found += layering_violations(open(path).read(), os.path.relpath(path, ROOT), forbidden)
    assert not found, "\n".join(found)


def test_no_family_is_named_outside_its_folder_and_the_registry():
    found = []
    for where in NO_FAMILY:
        for path in _python_files(where):
            found += family_names(open(path).read(), os.path.relpath(path, ROOT))
    assert not found, "model families named outside models/<family>/ and models/registry.py:\n" + "\n".join(found)


def test_every_top_level_package_has_its_layer():
    """A new top-level package or module must be placed in the layering (tests, examples and
    the C++ sources aside)."""
    tops = {n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))
            or (n.endswith(".py") and n != "setup.py")}
    placed = {name.split(".py")[0] for name in LAYERS} | {"benchmarks", "tests"}
    assert {t.split(".py")[0] for t in tops} <= placed, sorted(tops)
    assert [p.split(".py")[0] for p in LAYERS] == list(STACK[:len(LAYERS)])


def test_the_layering_and_name_checks_find_what_they_look_for():
    assert layering_violations("from training.planner.run import plan", "core/x.py", LAYERS["core"])
    assert layering_violations("import data.loader", "core/x.py", LAYERS["core"])
    assert layering_violations("from train_args import parse", "training/x.py", LAYERS["training"])
    assert not layering_violations("from core.init import local_rows", "models/x.py", LAYERS["models"])
    assert family_names("x = 1  # like Step37's router\n", "core/x.py")
    assert family_names('CACHE = "qwen3_moe"\n', "training/x.py")
    assert not family_names('"""Qwen and Step-3.7 in a docstring."""\nprog = "pretrain_step37.py"\n', "train_args.py")


def test_core_shows_its_parts_as_folders():
    """core/ reads as a table of contents: at most 14 modules at its top level, the rest in
    folders by job (checkpoint/, finetune/, costs/, moe/, ...), each folder with a docstring."""
    core = os.path.join(ROOT, "core")
    top = sorted(f for f in os.listdir(core) if f.endswith(".py") and f != "__init__.py")
    assert len(top) <= 14, top
    for name in os.listdir(core):
        init = os.path.join(core, name, "__init__.py")
        if os.path.isdir(os.path.join(core, name)) and name != "__pycache__":
            with open(init) as f:
                assert ast.get_docstring(ast.parse(f.read())), f"core/{name}/__init__.py has no docstring"
