"""Parquet and Arrow inputs -> units of work of whole rows, and the rows of one unit.

Formats, by file name: ``.parquet`` (Parquet), ``.arrow`` / ``.feather`` (Arrow IPC, the file
or the stream format, told apart by the file's first bytes), and a ``datasets.save_to_disk``
folder: Arrow stream files named by its ``state.json`` (``data/input_files.py`` expands the
folder; pyarrow reads them, ``datasets`` is not needed). Everything else is JSONL.

The parent reads only metadata: a Parquet file's footer (row groups), an Arrow file's footer or
an Arrow stream's message headers (memory-mapped, zero-copy, so no row is decoded). A unit is a
run of whole row groups or record batches (a record batch larger than ``chunk_bytes`` is cut
into row ranges) holding about ``chunk_bytes`` of the columns read; the worker reads its own
unit, and only the columns it needs, so memory is bounded by a unit (at least one Parquet row
group, which the writer sized). A damaged file ends its units with a ``{"file_error": ...}``
task, as a damaged gzip stream does (``data/input_chunks.py``).
"""
from __future__ import annotations

import json
import os

COLUMNAR = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow"}
ARROW_FILE_MAGIC = b"ARROW1"


def input_format(path: str) -> str:
    """``parquet``, ``arrow`` or ``jsonl`` (anything else, ``.gz`` included), by name."""
    return COLUMNAR.get(os.path.splitext(path)[1].lower(), "jsonl")


def _pa():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError("Parquet and Arrow inputs need pyarrow: pip install pyarrow "
                         "(or pip install -e '.[data]')") from None
    import pyarrow
    return pyarrow


def one_line(e: BaseException) -> str:
    """``Type: message`` on one line (pyarrow's messages can span several)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def read_errors() -> tuple:
    """What reading a damaged or unreadable file raises (pyarrow's errors where it is installed)."""
    try:
        import pyarrow
    except ImportError:
        return (OSError,)
    return (OSError, pyarrow.ArrowException)


def schema_names(path: str) -> list[str]:
    """The top-level column names of a Parquet or Arrow file; ``ValueError`` naming the file
    when it cannot be read as its format."""
    pa = _pa()
    fmt = input_format(path)
    try:
        if fmt == "parquet":
            return list(pa.parquet.ParquetFile(path).schema_arrow.names)
        with pa.memory_map(path) as src:
            if _is_arrow_file(path):
                return list(pa.ipc.open_file(src).schema.names)
            return list(pa.ipc.open_stream(src).schema.names)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot read it as {_kind(path)} ({one_line(e)}); "
                         "repair or remove the file") from None


def check_columns(path: str, columns: list[str], flag: str) -> None:
    """``ValueError`` before any work when ``path`` lacks a column the run reads."""
    names = schema_names(path)
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(repr(c) for c in missing)} ({flag}); its "
                         f"columns are {', '.join(names) or 'none'}")


def _kind(path: str) -> str:
    return "Parquet" if input_format(path) == "parquet" else "Arrow IPC"


def _is_arrow_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC


# ---------------------------------------------------------------------------------------------
# Parent: units of work from metadata
# ---------------------------------------------------------------------------------------------

def iter_units(path: str, chunk_bytes: int, columns: list[str]):
    """Tasks of about ``chunk_bytes`` of ``columns`` each, in row order; a damaged file ends
    with a ``file_error`` task once the units before the damage are out. The tasks' ``n_bytes``
    add up to the file's size (the progress bar counts file bytes, as for JSONL)."""
    pa = _pa()
    size, sent, held = os.path.getsize(path), 0, None
    try:
        parts = _parquet_parts(path, columns) if input_format(path) == "parquet" else \
            _arrow_parts(path, columns)
        for task in _group(parts, chunk_bytes, path):
            if held is not None:
                yield held
            held, sent = task, sent + task["n_bytes"]
    except (pa.ArrowException, OSError) as e:
        if held is not None:
            yield held
        yield {"path": path, "file_error": f"cannot read it as {_kind(path)} ({one_line(e)})"}
        return
    held = held or {"path": path, "format": input_format(path), "parts": [], "n_bytes": 0}
    held["n_bytes"] += max(0, size - sent)  # footers and headers
    yield held


def _parquet_parts(path: str, columns: list[str]):
    """(("rg", index), rows, bytes of the columns read uncompressed, bytes in the file)."""
    pa = _pa()
    meta = pa.parquet.ParquetFile(path).metadata
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        chunks = [rg.column(j) for j in range(rg.num_columns)
                  if rg.column(j).path_in_schema.split(".")[0] in columns]
        yield (("rg", i), rg.num_rows, sum(c.total_uncompressed_size for c in chunks),
               sum(c.total_compressed_size for c in chunks))


def _arrow_parts(path: str, columns: list[str]):
    """(("batch", index, offset of its message or None), rows, bytes, bytes) per record batch."""
    pa = _pa()
    with pa.memory_map(path) as src:
        if _is_arrow_file(path):
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                b = reader.get_batch(i)
                n = b.select(columns).nbytes
                yield ("batch", i, None), b.num_rows, n, n
            return
        messages = pa.ipc.MessageReader.open_stream(src)
        schema = pa.ipc.read_schema(messages.read_next_message())
        index, dictionaries = 0, any(_has_dictionary(f.type, pa) for f in schema)
        while True:
            pos = src.tell()
            try:
                m = messages.read_next_message()
            except StopIteration:
                return
            if m.type != "record batch":
                continue
            b = pa.ipc.read_record_batch(m, schema) if not dictionaries else None
            rows = b.num_rows if b is not None else -1
            n = b.select(columns).nbytes if b is not None else m.body.size
            yield ("batch", index, None if dictionaries else pos), rows, n, n
            index += 1


def _has_dictionary(t, pa) -> bool:
    """Whether values of type ``t`` need dictionary batches (then a stream is read in order)."""
    if pa.types.is_dictionary(t):
        return True
    return any(_has_dictionary(t.field(i).type, pa) for i in range(t.num_fields))


def _group(parts, chunk_bytes: int, path: str):
    """Consecutive parts joined up to ``chunk_bytes``; an Arrow batch above it cut into rows.
    A task: ``{"path", "format", "parts": [(where, first row, end row or None)], "n_bytes"}``
    (``n_bytes``: the file bytes it stands for, for the progress bar)."""
    fmt, unit, col_bytes, disk = input_format(path), [], 0, 0
    for where, n_rows, n, on_disk in parts:
        k = 1
        if where[0] == "batch" and n > chunk_bytes and n_rows > 1:
            k = min(n_rows, -(-n // chunk_bytes))  # zero-copy slices of one batch
        cuts = [n_rows * j // k for j in range(k + 1)] if n_rows >= 0 else [0, None]
        for a, b in zip(cuts[:-1], cuts[1:]):
            unit.append((where, a, b))
            col_bytes, disk = col_bytes + n // k, disk + on_disk // k
            if col_bytes >= chunk_bytes:
                yield {"path": path, "format": fmt, "parts": unit, "n_bytes": disk}
                unit, col_bytes, disk = [], 0, 0
    if unit:
        yield {"path": path, "format": fmt, "parts": unit, "n_bytes": disk}


def describe_unit(task: dict) -> str:
    """The row groups or record batches of a task, for error messages."""
    parts = task.get("parts") or []
    if not parts:
        return task["path"]
    what = "row group" if parts[0][0][0] == "rg" else "record batch"
    first, last = parts[0][0][1], parts[-1][0][1]
    span = f"{what} {first:,}" if first == last else f"{what}s {first:,}-{last:,}"
    return f"{task['path']} {span}"


# ---------------------------------------------------------------------------------------------
# Worker: the rows of one unit
# ---------------------------------------------------------------------------------------------

class BadValue:
    """A value that could not be converted to Python (invalid UTF-8 in a string, say)."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


def read_unit(task: dict, columns: list[str]) -> dict[str, list]:
    """``{column: [Python value per row]}`` for the rows of one task, in order."""
    pa = _pa()
    out: dict[str, list] = {c: [] for c in columns}
    for batch in _batches(task, columns, pa):
        for c in columns:
            out[c].extend(_to_python(batch.column(c)))
    return out


def _batches(task: dict, columns: list[str], pa):
    path = task["path"]
    if task["format"] == "parquet":
        pf = pa.parquet.ParquetFile(path, buffer_size=1 << 20)  # buffered: pages, not whole chunks
        groups = [w[1] for w, _, _ in task["parts"]]
        if not groups:
            return
        # one thread: the worker pool is the parallelism (pyarrow's own pool would oversubscribe)
        yield from pf.iter_batches(batch_size=4096, row_groups=groups, columns=columns, use_threads=False)
        return
    with pa.memory_map(path) as src:
        if _is_arrow_file(path):
            reader = pa.ipc.open_file(src)
            for (_, i, _), a, b in task["parts"]:
                yield _rows(reader.get_batch(i).select(columns), a, b)
            return
        if task["parts"] and task["parts"][0][0][2] is None:  # dictionaries: read in order
            wanted = [(w[1], a, b) for w, a, b in task["parts"]]
            for i, batch in enumerate(pa.ipc.open_stream(src)):
                for _, a, b in (p for p in wanted if p[0] == i):
                    yield _rows(batch.select(columns), a, b)
                if i >= wanted[-1][0]:
                    return
            return
        schema = pa.ipc.read_schema(pa.ipc.read_message(src))
        for (_, _, offset), a, b in task["parts"]:
            src.seek(offset)
            yield _rows(pa.ipc.read_record_batch(pa.ipc.read_message(src), schema).select(columns), a, b)


def _rows(batch, a: int, b: int | None):
    return batch.slice(a, (b if b is not None else batch.num_rows) - a)


def _to_python(column) -> list:
    """Python values of one column; a value that fails to convert becomes a :class:`BadValue`
    (only that row is lost)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    out = []
    for i in range(len(column)):
        try:
            out.append(column[i].as_py())
        except UnicodeDecodeError as e:
            out.append(BadValue("invalid_utf8", str(e)))
    return out


def strip_nulls(value):
    """Nested lists and structs with the null fields of their structs removed: Arrow stores
    every field of a struct type in every row, so a message without ``tool_calls`` holds
    ``tool_calls: null``; as in JSON, such a field is absent."""
    if isinstance(value, dict):
        return {k: strip_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_nulls(v) for v in value]
    return value


def row_text(values: dict) -> str:
    """A rejected row's columns as JSON, for the rejects file."""
    return json.dumps({k: (None if isinstance(v, BadValue) else v) for k, v in values.items()},
                      ensure_ascii=False, default=_short)


def _short(v) -> str:
    """Bytes (an image column's) as their size, not their repr: a rejects file stays readable."""
    return f"<{len(v):,} bytes>" if isinstance(v, (bytes, bytearray)) else str(v)
