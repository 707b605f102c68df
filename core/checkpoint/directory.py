"""The directory protocol of training checkpoints: names, atomic publication, pruning, and
which checkpoint a ``--load`` directory means. Plain file-system operations, run by rank 0
(``resolve`` by every rank: it only reads).

Names under ``--save``::

    iter_0000200/         a published checkpoint (``meta.json`` present)
    iter_0000200.tmp/     being written; never loaded, removed by the next save
    iter_0000200.next/    a complete copy that replaces iter_0000200 (re-saving an iteration)
    iter_0000200.trash/   being removed
    latest                one line: the name of the checkpoint to resume from

Every step is one ``os.replace`` (atomic on POSIX), ordered so that a kill between any two of
them leaves ``latest`` naming a complete checkpoint: a directory is renamed to ``.trash`` before
``rmtree`` (a half-removed checkpoint never keeps its name), and re-saving iteration N points
``latest`` at ``iter_N.next`` before the old ``iter_N`` goes. The one window where ``latest``
names a directory that is gone (``iter_N.next`` just renamed to ``iter_N``) is followed by
``resolve`` to ``iter_N``, which holds exactly that copy.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings

POINTER = "latest"
_ITER_RE = re.compile(r"^iter_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file and what to do."""


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def iteration_of(name: str) -> int | None:
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json"))


def read_pointer(save_dir: str) -> str | None:
    path = os.path.join(save_dir, POINTER)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); write the name of a complete iter_* "
                              "directory into it") from e
    if not name or os.sep in name or name in (".", ".."):
        raise CheckpointError(f"{path}: {name!r} is not a checkpoint directory name; write the "
                              "name of a complete iter_* directory into it")
    return name


def write_pointer(save_dir: str, name: str) -> None:
    path = os.path.join(save_dir, POINTER)
    with open(path + ".tmp", "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def resolve(load_dir: str, what: str = "--load") -> str:
    """``load_dir`` itself if it is a checkpoint, else the complete one its ``latest`` names;
    ``what``: how errors name the path (the flag or argument it came from)."""
    if is_complete(load_dir):
        return load_dir
    name = read_pointer(load_dir)
    if name is None:
        raise CheckpointError(f"{what} {load_dir}: no 'latest' pointer and not a checkpoint directory")
    path = os.path.join(load_dir, name)
    if name.endswith(".next") and not os.path.exists(path):
        path = path[:-len(".next")]  # the re-save's last rename happened, the pointer update not
    if not is_complete(path):
        raise CheckpointError(f"{path}: incomplete checkpoint (no meta.json); the save did not "
                              f"finish. Point {what} at an earlier iter_* directory.")
    return path


def check_writable(save_dir: str) -> None:
    """Create ``save_dir`` if needed and write a file in it; ``ValueError`` naming the flag."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_test_", dir=save_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--save {save_dir}: cannot write there ({e.strerror or e}); choose a "
                         "writable directory") from e


def discard(path: str) -> None:
    """Remove a directory so that no half-removed copy keeps its name."""
    if not os.path.exists(path):
        return
    trash = path + ".trash" if not path.endswith(".trash") else path
    if trash != path:
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
    shutil.rmtree(trash)


def prepare(save_dir: str, iteration: int) -> str:
    """Rank 0, before a save: finish an interrupted re-save, drop leftovers of failed or killed
    saves, and create the empty ``iter_N.tmp`` to write into (returned)."""
    os.makedirs(save_dir, exist_ok=True)
    _repair(save_dir)
    pointed = read_pointer(save_dir)
    for name in os.listdir(save_dir):
        if name.endswith((".tmp", ".trash")) or (name.endswith(".next") and name != pointed):
            if os.path.isdir(os.path.join(save_dir, name)):
                discard(os.path.join(save_dir, name))
    tmp = os.path.join(save_dir, iter_name(iteration) + ".tmp")
    os.makedirs(tmp)
    return tmp


def _repair(save_dir: str) -> None:
    """``latest`` names ``iter_N.next`` (a re-save was killed before its end): finish it."""
    name = read_pointer(save_dir)
    if not name or not name.endswith(".next"):
        return
    final = os.path.join(save_dir, name[:-len(".next")])
    nxt = os.path.join(save_dir, name)
    if os.path.exists(nxt):
        discard(final)
        os.replace(nxt, final)
    write_pointer(save_dir, os.path.basename(final))


def publish(save_dir: str, iteration: int, keep_last: int = 0) -> str:
    """Rank 0, once every rank has written ``iter_N.tmp`` and its ``meta.json`` is there: make
    it ``iter_N``, point ``latest`` at it, prune. Returns the checkpoint's path."""
    final = os.path.join(save_dir, iter_name(iteration))
    tmp = final + ".tmp"
    if os.path.exists(final):  # re-saving an iteration: the old copy goes only once unreferenced
        nxt = final + ".next"
        discard(nxt)
        os.replace(tmp, nxt)
        write_pointer(save_dir, os.path.basename(nxt))
        discard(final)
        os.replace(nxt, final)
    else:
        os.replace(tmp, final)
    write_pointer(save_dir, os.path.basename(final))
    if keep_last > 0:
        prune(save_dir, keep_last, protect={os.path.basename(final)})
    return final


def prune(save_dir: str, keep_last: int, protect: set = frozenset()) -> list[str]:
    """Keep the ``keep_last`` complete checkpoints with the highest iteration numbers, plus those
    in ``protect`` and the one ``latest`` names; remove the rest. Returns what was removed."""
    done = sorted((it, name) for name in os.listdir(save_dir)
                  if (it := iteration_of(name)) is not None and is_complete(os.path.join(save_dir, name)))
    keep = {name for _, name in done[-keep_last:]} | set(protect)
    pointed = read_pointer(save_dir)
    if pointed:
        keep.add(pointed.removesuffix(".next"))
    newest_written = max((iteration_of(p) or -1 for p in protect), default=-1)
    later = [name for it, name in done if it > newest_written]
    if later:
        warnings.warn(f"{save_dir}: {len(later)} checkpoint(s) of later iterations than this run's "
                      f"({', '.join(later[:3])}{'...' if len(later) > 3 else ''}), from an earlier run "
                      f"or before a rollback; --keep-last counts them, 'latest' names this run's",
                      stacklevel=2)
    removed = [name for _, name in done if name not in keep]
    for name in removed:
        discard(os.path.join(save_dir, name))
    return removed
