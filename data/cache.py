"""Where files derived from a dataset (pack plans, statistics) are cached.

* ``--data-cache-path DIR`` (Megatron's flag): always in ``DIR``.
* Otherwise beside the dataset, as Megatron does (``PREFIX_packplan_<hash>_*``,
  ``PREFIX.meta.json``), and when the dataset's directory cannot be written (read-only storage,
  another user's files) in the user cache, ``$XDG_CACHE_HOME/step37-trainer`` (default
  ``~/.cache/step37-trainer``), with a warning naming both places.
* When no place can be written, the value is used uncached, with a warning.

Files in a cache directory are named after the dataset's file name and a hash of its absolute
path, so datasets with the same name in different directories never share an entry. Writes go
to temporary names renamed in order, the last file marking the set complete, so concurrent
ranks and interrupted runs never leave a half-written entry that looks complete.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from typing import Callable, Sequence

APP = "step37-trainer"


def user_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, APP)


def _entry_name(prefix: str) -> str:
    path = os.path.abspath(prefix)
    return f"{os.path.basename(path)}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def cache_bases(prefix: str, cache_path: str | None = None) -> list[str]:
    """Path prefixes to write cache files of dataset ``prefix`` under, in order of preference."""
    if cache_path:
        return [os.path.join(cache_path, _entry_name(prefix))]
    return [str(prefix), os.path.join(user_cache_dir(), _entry_name(prefix))]


def read_bases(prefix: str, cache_path: str | None = None) -> list[str]:
    """Path prefixes to look for cache files under: beside the dataset first (where
    ``tools/preprocess_data.py`` writes the statistics sidecar), then the cache."""
    return list(dict.fromkeys([str(prefix)] + cache_bases(prefix, cache_path)))


def save(bases: Sequence[str], suffixes: Sequence[str], write: Callable, what: str) -> str | None:
    """Write ``base + suffix`` for every suffix under the first base that accepts them.

    ``write(suffix, file)`` fills one open binary file. Returns the base used, or None when no
    place could be written (a warning says why; the caller goes on without a cache).
    """
    errors = []
    for base in bases:
        try:
            _save_in(base, suffixes, write)
        except OSError as e:
            errors.append(f"{os.path.dirname(os.path.abspath(base))}: {e.strerror or e}")
            continue
        if errors:
            warnings.warn(f"could not cache the {what} in {errors[0]}; cached it under {base} "
                          "instead (choose the place with --data-cache-path)", stacklevel=3)
        return base
    warnings.warn(f"could not cache the {what} anywhere ({'; '.join(errors)}); it will be "
                  "recomputed next time (choose a writable place with --data-cache-path)",
                  stacklevel=3)
    return None


def _save_in(base: str, suffixes: Sequence[str], write: Callable) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    tag = f".tmp-{os.getpid()}"
    tmps: list[str] = []
    try:
        for s in suffixes:
            tmps.append(base + s + tag)
            with open(tmps[-1], "wb") as f:
                write(s, f)
        for s, tmp in zip(suffixes, tmps):
            os.replace(tmp, base + s)
    except BaseException:
        for tmp in tmps:
            try:
                os.remove(tmp)
            except OSError:
                pass
        raise
