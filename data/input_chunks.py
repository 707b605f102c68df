"""JSONL inputs -> chunks of whole lines, the unit of work of tools/preprocess_data.py.

For a plain file a chunk is a byte range that the worker reads itself, so the parent never
touches the text. A ``.gz`` file cannot be seeked, so the parent decompresses it and ships the
chunk's bytes. A file that cannot be read (a truncated or invalid gzip stream, an I/O error)
ends with a ``{"file_error": ...}`` task; the rows before the damage are read and counted first.
"""
from __future__ import annotations

import gzip
import os
import zlib


def iter_chunks(path: str, chunk_bytes: int):
    """Chunks of whole lines: byte ranges for plain files, bytes for .gz files. A file that
    cannot be read (a truncated or invalid gzip stream, an I/O error) ends with a
    ``{"file_error": ...}`` task, which stops the run once the rows before it are counted."""
    try:
        if path.endswith(".gz"):
            yield from _gzip_chunks(path, chunk_bytes)
            return
        size = os.path.getsize(path)
        start = 0
        with open(path, "rb") as f:
            while start < size:
                end = min(start + chunk_bytes, size)
                if end < size:
                    f.seek(end)
                    tail = f.readline()  # extend to the end of the line we landed in
                    end += len(tail)
                yield {"path": path, "start": start, "end": end}
                start = end
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        what = "truncated or corrupt gzip stream" if path.endswith(".gz") else "read error"
        yield {"path": path, "file_error": f"{what} ({type(e).__name__}: {e})"}


def _gzip_chunks(path: str, chunk_bytes: int):
    """Whole lines of a gzip file. On a damaged stream the whole rows decompressed so far are
    handed over first (``read1`` returns what it has), then the error propagates."""
    with gzip.open(path, "rb") as f:
        rest, pos, eof = b"", 0, False  # pos: decompressed offset of rest
        while not eof:
            parts, n, err = [rest], len(rest), None
            try:
                while n < chunk_bytes:
                    piece = f.read1(chunk_bytes - n)
                    if not piece:
                        eof = True
                        break
                    parts.append(piece)
                    n += len(piece)
            except (OSError, EOFError, zlib.error) as e:
                err = e
            block = b"".join(parts)
            cut = len(block) if eof else block.rfind(b"\n") + 1  # a damaged last row is dropped
            if cut:
                yield {"data": block[:cut], "path": path, "start": pos, "end": pos + cut}
                pos += cut
            rest = block[cut:]
            if err is not None:
                raise err


def describe_task(task: dict) -> str:
    """The input range of a task, for error messages."""
    if "start" not in task:
        return task.get("path", "?")
    unit = "decompressed bytes" if "data" in task else "bytes"
    return f"{task['path']} {unit} {task['start']:,}-{task['end']:,}"
