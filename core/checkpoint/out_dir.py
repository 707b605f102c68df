"""Output folders that a tool writes files into (an export, the GPU check's results): what it
may find there and what it does with it, in one place.

Policy (every exporter: full and merged Hugging Face exports, PEFT adapter folders, and
``tools/gpu_check.py --out``):

- A folder holding only files a run of the same tool writes (``owned``: names or shell patterns)
  is reused: those files are *all* removed before the new ones are written, so nothing of an
  earlier run of another kind stays behind (a merged export over a PEFT one leaves no
  ``adapter_config.json``, which transformers would load on top of the merged weights; a PEFT
  export over a full one leaves no ``model*.safetensors``).
- A folder holding any other file is refused by name, unless the tool was told ``--overwrite``:
  then the files it owns are replaced as above and the others are left alone (and listed).
  Nothing that is not ours is ever deleted.
- A path where a file stands, or a folder (or the nearest existing parent of a new one) where
  no file can be created, is refused in one line before any work.
"""
from __future__ import annotations

import fnmatch
import os
import tempfile

# what any Hugging Face export of this project writes: the weights (one file, or shards and their
# index), config.json, and a PEFT adapter folder's two files; a family's side files are added
# by the caller (``weight_adapter.side_files``, e.g. Step-3.7's head and MTP file)
HF_EXPORT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
                   "model-[0-9][0-9][0-9][0-9][0-9]-of-[0-9][0-9][0-9][0-9][0-9].safetensors",
                   "adapter_config.json", "adapter_model.safetensors")


def export_files(side_files=()) -> tuple:
    """The names a Hugging Face export (any kind) of a family with ``side_files`` writes."""
    return HF_EXPORT_FILES + tuple(side_files)


def _owned(name: str, owned) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in owned)


def split_files(out: str, owned) -> tuple[list[str], list[str]]:
    """``(files of ours, other entries)`` in the folder ``out`` (names, sorted; both empty when it
    does not exist)."""
    if not os.path.isdir(out):
        return [], []
    names = sorted(os.listdir(out))
    ours = [n for n in names if _owned(n, owned) and os.path.isfile(os.path.join(out, n))]
    return ours, [n for n in names if n not in ours]


def _can_write(folder: str) -> OSError | None:
    """None when a file can be created in ``folder`` (tried, then removed), else the error."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_test_", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return e
    return None


def check_out_dir(out: str, owned, *, flag: str, tool: str, overwrite: bool | None = False) -> list[str]:
    """Refuse (``ValueError``, one line naming ``flag``) an output folder ``out`` that ``tool``
    cannot or must not write into (module docstring); returns the files of ours it holds, which
    :func:`clear_owned` removes. ``overwrite`` None: the tool has no ``--overwrite`` (a folder
    with other files is always refused). Creates nothing."""
    path = os.path.abspath(out)
    part = path
    while not os.path.exists(part) and os.path.dirname(part) != part:
        part = os.path.dirname(part)
    if not os.path.isdir(part):
        where = "is a file" if part == path else f"is inside {part}, which is a file"
        raise ValueError(f"{flag} {out} {where}, not a folder: {tool} writes a folder there; remove the file or "
                         f"choose another {flag}")
    error = _can_write(part)
    if error is not None:
        where = "" if part == path else f" (its nearest existing parent {part})"
        raise ValueError(f"{flag} {out}: cannot write there{where} ({error.strerror or error}); choose a "
                         "writable folder")
    ours, others = split_files(out, owned)
    if others and not overwrite:
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        hint = "" if overwrite is None else (", or pass --overwrite to write into it anyway (files of an earlier "
                                             "run are replaced, the others kept)")
        raise ValueError(f"{flag} {out} holds files {tool} did not write ({listed}): choose an empty or new "
                         f"folder{hint}")
    return ours


def clear_owned(out: str, owned) -> list[str]:
    """Remove the files of ours in ``out`` (names matching ``owned``); returns their names."""
    ours, _ = split_files(out, owned)
    for name in ours:
        os.remove(os.path.join(out, name))
    return ours
