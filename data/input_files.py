"""Which files a preprocessing run reads: ``--input`` patterns expanded, each file once, and
never a file that preprocessing writes.

A run writes ``PREFIX_<key>_document.{bin,idx,meta.json}``, ``PREFIX_rejects.jsonl`` and
temporaries of those names ending ``.tmp-<pid>``. A glob such as ``dir/*.jsonl`` with
``--output-prefix dir/out`` matches the rejects file of the previous run, whose records are valid
JSON with a ``"text"`` key: read back, the rejected rows would become documents. So:

* a glob match whose name is one of those outputs, of this run's prefix or any other, is left
  out, and the run says which files it left out;
* a file named explicitly that is such an output is refused, as is an ``--output-prefix`` that
  is itself an input, or an input that this run would overwrite;
* a file given twice (the same path twice, or a glob and a name, or two names of one file) is
  read once, and the run says so.

A ``datasets.save_to_disk`` folder (``state.json`` and ``dataset_info.json`` beside Arrow
files) stands for the Arrow files its ``state.json`` lists, in that order; given by name or
matched by a glob, its files follow the same rules. A ``DatasetDict`` folder (one folder per
split, ``dataset_dict.json``) is refused naming its splits: training on all of them at once would
mix the test split into the training data. Any other folder given by name is refused.
"""
from __future__ import annotations

import glob
import json
import os
import re

# names preprocess_data.py writes, for any prefix (a temporary adds .tmp-<pid>)
_OUTPUT = re.compile(r"(_rejects\.jsonl|_document\.bin|_document\.idx|\.meta\.json)(\.tmp-\d+)?$"
                     r"|\.tmp-\d+$")


def is_tool_output(path: str) -> bool:
    """Whether ``path`` is named like a file that preprocessing writes (for any prefix)."""
    return bool(_OUTPUT.search(os.path.basename(path)))


def run_outputs(prefix: str, keys: list[str]) -> list[str]:
    """The published names this run writes under ``prefix`` (``keys``: text keys, and
    ``loss_mask`` for chat)."""
    names = [f"{prefix}_{k}_document{ext}" for k in keys for ext in (".bin", ".idx", ".meta.json")]
    return names + [f"{prefix}_rejects.jsonl"]


def is_saved_dataset(path: str) -> bool:
    """Whether ``path`` is a ``datasets.save_to_disk`` folder of one split."""
    return all(os.path.isfile(os.path.join(path, n)) for n in ("state.json", "dataset_info.json"))


INPUT_ENDINGS = (".parquet", ".arrow", ".feather", ".jsonl", ".jsonl.gz", ".json", ".json.gz")


def _folder_hint(path: str) -> str:
    """How to give the input files a folder holds: a glob per kind it holds, as many as are."""
    names = [n for n in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, n))
             and not is_tool_output(n)]
    endings = [e for e in INPUT_ENDINGS if any(n.endswith(e) for n in names)]
    if not endings:
        return (f"it holds no {', '.join(INPUT_ENDINGS)} file; give the input files by name or "
                "glob")
    globs = " ".join(f"'{os.path.join(path, '*' + e)}'" for e in endings)
    return f"give its files: --input {globs}"


def saved_dataset_files(path: str) -> list[str]:
    """The Arrow files of a ``save_to_disk`` folder, in its ``state.json``'s order;
    ``ValueError`` for a folder that is not one (a ``DatasetDict``'s names its splits)."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json"), encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
        raise ValueError(f"--input {path}: a datasets DatasetDict with splits {', '.join(splits)}; give "
                         f"one split's folder (--input {os.path.join(path, (splits or ['train'])[0])})"
                         ", so that no test split is trained on")
    if not is_saved_dataset(path):
        raise ValueError(f"--input {path}: a folder, but not a datasets.save_to_disk folder (no "
                         f"state.json and dataset_info.json); {_folder_hint(path)}")
    state_path = os.path.join(path, "state.json")
    try:
        with open(state_path, encoding="utf-8") as f:
            names = [d["filename"] for d in json.load(f)["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{state_path}: no list of data files (_data_files) in it "
                         f"({type(e).__name__}: {e})") from None
    files = [os.path.join(path, n) for n in names]
    for f_ in files:
        if not os.path.isfile(f_):
            raise FileNotFoundError(f"--input {path}: {state_path} names {f_}, which is missing")
    if not files:
        raise ValueError(f"--input {path}: {state_path} lists no data file")
    return files


def _glob(pat: str) -> tuple[list[str], list[str]]:
    """(input files a glob matches, its matches that preprocessing writes); folders it matches
    count only when they are save_to_disk folders."""
    hits, own = [], []
    for h in sorted(glob.glob(pat)):
        if os.path.isdir(h) and is_saved_dataset(h):
            hits += saved_dataset_files(h)
        elif os.path.isfile(h):
            (own if is_tool_output(h) else hits).append(h)
    return hits, own


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def expand_inputs(patterns: list[str], prefix: str | None = None,
                  keys: list[str] = ()) -> tuple[list[str], list[str]]:
    """(files to read, in order, each once; notes to tell the user). ``FileNotFoundError``
    for a pattern that matches nothing; ``ValueError`` for an input that preprocessing writes
    (explicitly named), or one that this run's ``prefix`` would overwrite."""
    outputs = run_outputs(prefix, list(keys)) if prefix else []
    files, seen, notes = [], {}, []
    for pat in patterns:
        if glob.has_magic(pat):
            hits, own = _glob(pat)
            if own:
                notes.append(f"--input {pat!r}: left out {len(own)} file(s) that preprocessing "
                             f"writes (rejects, datasets, temporaries), never read as input: "
                             f"{', '.join(own[:5])}{' ...' if len(own) > 5 else ''}")
            if not hits and not own:
                raise FileNotFoundError(f"--input {pat!r}: no such file")
            if not hits:
                raise FileNotFoundError(f"--input {pat!r}: matches only files that preprocessing "
                                        "writes, no input")
        elif os.path.isdir(pat):
            hits = saved_dataset_files(pat)
        elif os.path.isfile(pat):
            _refuse_output(pat, outputs)
            hits = [pat]
        else:
            raise FileNotFoundError(f"--input {pat!r}: no such file")
        for h in hits:
            _refuse_overwrite(h, outputs, prefix)
            st = os.stat(h)
            key = (st.st_dev, st.st_ino)
            if key in seen:
                seen[key].append(h)
                continue
            seen[key] = [h]
            files.append(h)
    for names in seen.values():
        if len(names) > 1:
            notes.append(f"--input: {names[0]} was given {len(names)} times "
                         f"({', '.join(repr(n) for n in names)}): read once")
    return files, notes


def _refuse_output(path: str, outputs: list[str]) -> None:
    if is_tool_output(path) or any(_same(path, o) for o in outputs):
        raise ValueError(f"--input {path}: this is a file that preprocessing writes (a rejects "
                         "file, a dataset, its sidecar or a temporary), not input; a rejects "
                         "file holds rejected rows with their reasons. Give the original inputs (a "
                         "glob the shell expanded? quote it, --input 'dir/*.jsonl', and such files "
                         "are left out)")


def _refuse_overwrite(path: str, outputs: list[str], prefix: str | None) -> None:
    if prefix is not None and _same(path, prefix):
        raise ValueError(f"--output-prefix {prefix} is also an --input file; choose another prefix "
                         "(outputs are PREFIX_<key>_document.bin/.idx and PREFIX_rejects.jsonl)")
    for o in outputs:
        if _same(path, o):
            raise ValueError(f"--input {path}: --output-prefix {prefix} would overwrite it; "
                             "choose another --output-prefix")
