"""core/ is model-agnostic: no identifier, attribute or string outside docstrings names a
model's parameters, modules or private methods. The model declares what core needs
(core/model_api.py) instead."""
from __future__ import annotations

import ast
import os

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
