"""Reading a training checkpoint without trusting it: every failure is a ``CheckpointError``
naming the file, and nothing in the checkpoint can run code.

What is read and how:

- ``.metadata`` (DCP's index, a pickle): a restricted unpickler that builds only DCP's metadata
  types, ``torch.Size``, dtypes and layouts, and ``pathlib`` paths; any other global (``os.system``,
  ``builtins.eval``...) refuses the file before anything is called. Plain ``pickle.load``, what
  ``FileSystemReader`` does, would run a crafted file's code on ``--load``.
- ``*.distcp`` (tensor data): DCP reads each tensor with ``torch.load(weights_only=True)``; every
  file the index names is checked first to lie inside the checkpoint and be long enough for the
  bytes the index says it holds (a truncated file is named before any read).
- ``extra_rank*.pt``: ``torch.load(weights_only=True)``; ``meta.json``: JSON.

DCP raises ``CheckpointException``, a ``BaseException`` that ``except Exception`` misses: it is
caught here too.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from core.checkpoint.directory import CheckpointError

METADATA_FILE = ".metadata"

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refers to {module}.{name}, which is not a DCP metadata type")


def read_dcp_metadata(path: str) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` of checkpoint directory ``path``, unpickled with only DCP's types."""
    file = os.path.join(path, METADATA_FILE)
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; the checkpoint is incomplete or not a DCP "
                              "checkpoint") from None
    except Exception as e:
        raise CheckpointError(f"{file}: refused ({type(e).__name__}: {e}); this file is not what "
                              "DCP writes: corrupted or crafted. Load an earlier iter_* directory") from e
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{file}: refused: not DCP checkpoint metadata "
                              f"({type(md).__name__})")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = dcp_metadata.StorageMeta()
    _check_data_files(path, md)
    return md


def _check_data_files(path: str, md: dcp_metadata.Metadata) -> None:
    """Every data file the index names is inside ``path`` and holds the bytes it should."""
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or os.path.isabs(rel) or os.path.normpath(rel) != rel or rel.startswith(".."):
            raise CheckpointError(f"{os.path.join(path, METADATA_FILE)}: refused: names data file "
                                  f"{rel!r} outside the checkpoint directory")
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing (the checkpoint's index lists it); the "
                                  "checkpoint is incomplete. Load an earlier iter_* directory")
        if os.path.getsize(file) < size:
            raise CheckpointError(f"{file}: truncated ({os.path.getsize(file)} bytes, the index "
                                  f"needs {size}). Load an earlier iter_* directory")


class _TrackingFileSystem(FileSystem):
    """DCP's file system, remembering the last file opened (to name it in errors)."""

    last: str | None = None

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        self.last = str(path)
        with super().create_stream(path, mode) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """``FileSystemReader`` with the restricted ``.metadata`` reader; ``last_file`` names the data
    file being read when an error happened."""

    def __init__(self, path: str):
        super().__init__(path)
        self.fs = _TrackingFileSystem()
        self._dir = str(path)

    @property
    def last_file(self) -> str | None:
        return self.fs.last

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not what our saves write
            raise CheckpointError(f"{self._dir}: per-rank DCP metadata is not supported")
        md = read_dcp_metadata(self._dir)
        md.storage_meta.load_id = self.load_id
        return md


@contextlib.contextmanager
def reading(what: str):
    """Turn any failure inside (DCP's ``CheckpointException`` included) into a
    ``CheckpointError`` that starts with ``what`` (a file or directory)."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"{what}: cannot read ({_describe(e)}). The checkpoint is corrupted "
                              "or incomplete; load an earlier iter_* directory") from e


def _describe(e: BaseException) -> str:
    if isinstance(e, CheckpointException):  # one entry per failed rank: show the first cause
        failures = getattr(e, "failures", {}) or {}
        for cause in failures.values():
            inner = cause[0] if isinstance(cause, tuple) else cause
            return f"{type(inner).__name__}: {inner}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def read_meta(path: str) -> dict:
    """``meta.json`` of checkpoint ``path``: a dict with an integer ``iteration``."""
    file = os.path.join(path, "meta.json")
    with reading(file):
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or not isinstance(meta.get("iteration"), int) \
                or meta["iteration"] < 0:
            raise ValueError("expected an object with a non-negative integer 'iteration'")
    return meta


def read_extra(path: str, rank: int) -> dict:
    """This rank's small state (loader position, RNG), or {} when the save had none for it."""
    file = os.path.join(path, f"extra_rank{rank}.pt")
    if not os.path.exists(file):
        return {}
    with reading(file):
        extra = torch.load(file, weights_only=True)
        if not isinstance(extra, dict):
            raise ValueError(f"expected a dict, got {type(extra).__name__}")
    return extra
