#!/usr/bin/env python3
"""Writes pydoc_corpus.jsonl: real English from the Python standard library's own documentation.

Sources, both shipped with every CPython and read from this interpreter's standard library (no
network, nothing imported but pydoc_data):

* ``pydoc_data/topics.py``: the language reference topics that ``help("assert")`` prints,
  cut at blank lines into documents of at most --max-chars characters;
* the docstrings of the standard library's modules, classes and functions of at least
  --min-chars characters, read with ``ast`` from the source files (never imported: importing
  ``antigravity`` opens a web browser), tests, IDLE, tkinter and turtledemo left out.

Licence: both are part of Python, under the PSF License Agreement; the script copies the
interpreter's ``LICENSE.txt`` beside the corpus as PYTHON_LICENSE.txt. Rows are
``{"text", "source"}``, shuffled with a fixed seed so that a contiguous held-out part (training's
``--split``) is a random sample. The output depends only on the Python version it runs under
(README.md there names the one the shipped file was made with).

    python examples/data/make_pydoc_corpus.py [--out-dir examples/data]
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import sys
import sysconfig

SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
             "distutils", "site-packages", "dist-packages", "__pycache__"}


def topic_documents(max_chars: int) -> list[dict]:
    """The pydoc topics, cut at paragraph boundaries into pieces of at most ``max_chars``."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        piece, part = [], 1
        for para in topics[name].split("\n\n"):
            if piece and sum(len(p) + 2 for p in piece) + len(para) > max_chars:
                docs.append({"text": "\n\n".join(piece), "source": f"pydoc_data/topics.py: {name} ({part})"})
                piece, part = [], part + 1
            piece.append(para)
        if piece:
            docs.append({"text": "\n\n".join(piece), "source": f"pydoc_data/topics.py: {name} ({part})"})
    return [d for d in docs if d["text"].strip()]


def stdlib_files(stdlib: str) -> list[str]:
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return files


def docstring_documents(stdlib: str, min_chars: int) -> list[dict]:
    """Docstrings of at least ``min_chars`` characters, with the file and object they document."""
    docs = []
    for path in stdlib_files(stdlib):
        rel = os.path.relpath(path, stdlib)
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few files are deliberately broken or in another encoding
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= min_chars:
                    what = getattr(node, "name", "module")
                    docs.append({"text": text, "source": f"{rel}: {what}"})
    return docs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--max-chars", type=int, default=2000, help="longest topic piece")
    ap.add_argument("--min-chars", type=int, default=200, help="shortest docstring kept")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = topic_documents(args.max_chars) + docstring_documents(stdlib, args.min_chars)
    random.Random(args.seed).shuffle(docs)
    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, "pydoc_corpus.jsonl")
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    licence = os.path.join(stdlib, "LICENSE.txt")
    if os.path.exists(licence):
        shutil.copyfile(licence, os.path.join(args.out_dir, "PYTHON_LICENSE.txt"))
    chars = sum(len(d["text"]) for d in docs)
    print(f"make_pydoc_corpus: {len(docs):,} documents, {chars:,} characters from Python "
          f"{sys.version.split()[0]}'s pydoc_data/topics.py and docstrings -> {out} (PSF licence: "
          f"{'PYTHON_LICENSE.txt beside it' if os.path.exists(licence) else 'LICENSE.txt not found'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
