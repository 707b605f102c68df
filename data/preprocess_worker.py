"""One unit of work of tools/preprocess_data.py -> token arrays and rejected rows.

A unit is a chunk of whole JSONL lines (``data/input_chunks.py``) or a run of Parquet row groups /
Arrow record batches (``data/columnar.py``). Either way the rows go through the same checks and
the same encoding, so the same rows give the same tokens whatever file they came in. Anything
wrong with one row (bad JSON or UTF-8, a lone surrogate escape, nesting deeper than the JSON
parser's recursion limit, a value of the wrong type, an exception from the tokenizer or chat
template) rejects that row with a reason; anything wrong with the file (a read error, a damaged
row group) is a ``file_error``, which stops the run naming the file.

A reject is ``(row index in the unit, reason, detail, original row)``: the row's bytes for JSONL,
its columns as JSON for Parquet and Arrow.
"""
from __future__ import annotations

import codecs
import itertools
import json
import os
from typing import Any

import numpy as np

from data.chat import SURROGATE, RowError
from data.columnar import (BadValue, describe_unit, one_line, read_errors, read_unit, row_text,
                           schema_names, strip_nulls)
from data.image_chat import encode_image_chat
from data.images import DEFAULT_MAX_IMAGE_PIXELS, checksum
from data.indexed_dataset import token_dtype
from data.tokenizers import build_tokenizer

_worker: dict = {}


IMAGES_COLUMN = "images"  # chat rows: the row's images, in the order of its image parts


def init_worker(cfg: Any, image_processor=None) -> None:
    """``image_processor``: a picklable factory ``token_id -> ImageProcessor`` (``data/images.py``),
    called here with the tokenizer's ``token_id``, or None for text-only runs."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker process
    tok = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)
    proc = image_processor(tok.token_id) if image_processor is not None else None
    _worker.update(cfg=cfg, tok=tok, dtype=token_dtype(tok.vocab_size), proc=proc, schemas={})


def read_columns(cfg: Any) -> list[str]:
    """The keys (columns) a run reads: the text keys, or the chat key."""
    return [cfg.chat] if cfg.chat else list(cfg.json_keys)


def reject_reason(exc: Exception, default: str) -> tuple[str, str]:
    """(reason, detail) for any exception raised while handling one row."""
    if isinstance(exc, RowError):
        return exc.reason, exc.detail
    if isinstance(exc, RecursionError):
        return "too_deep", "nested deeper than the JSON parser's recursion limit"
    if isinstance(exc, UnicodeError):
        return "invalid_unicode", str(exc)
    return default, f"{type(exc).__name__}: {exc}"


def _check_unicode(key: str, value: str) -> None:
    """A JSON ``\\ud800`` escape without its pair decodes to a lone surrogate, which no UTF-8
    tokenizer can encode."""
    m = SURROGATE.search(value)
    if m:
        raise RowError("invalid_unicode", f"{key!r} holds a lone surrogate {m.group()!r} at "
                                          f"character {m.start()} (a \\ud800-\\udfff escape "
                                          "without its pair)")


def row_values(row: dict, cfg: Any, missing: str = "no key {!r}", surrogates: bool = True):
    """The values of one row (a dict) to encode: the messages (chat) or the text of each key;
    ``RowError`` for a missing key, a value of the wrong type or an empty text."""
    keys = read_columns(cfg)
    for k in keys:
        if k not in row:
            raise RowError("missing_key", missing.format(k))
        if isinstance(row[k], BadValue):
            raise RowError(row[k].reason, f"{k!r}: {row[k].detail}")
    if cfg.chat:  # encode_chat checks the rendered text for lone surrogates
        return row[cfg.chat], row.get(IMAGES_COLUMN)
    values = [row[k] for k in keys]
    for k, v in zip(keys, values):
        if not isinstance(v, str):
            raise RowError("wrong_type", f"{k!r} must be a string, got {type(v).__name__}")
        if not v.strip():
            raise RowError("empty_text", f"{k!r} is empty after stripping whitespace")
        if surrogates:
            _check_unicode(k, v)
    return values


def _parse_line(raw: bytes, cfg: Any):
    """Bytes of one JSONL line -> the values to encode, or RowError."""
    if not raw.strip():
        raise RowError("blank_line", "the line is empty")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowError("invalid_utf8", str(e)) from None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise RowError("invalid_json", str(e)) from None
    if not isinstance(row, dict):
        raise RowError("not_an_object", f"expected a JSON object, got {type(row).__name__}")
    # only a \\u escape can produce a surrogate in valid UTF-8 input
    return row_values(row, cfg, surrogates=b"\\u" in raw)


def _jsonl_rows(task: dict, cfg: Any):
    """(rows in the unit, [(index, values)], rejects, original row of an index)."""
    data = task.get("data")
    if data is None:
        data = _read_range(task["path"], task["start"], task["end"])
    if task["start"] == 0 and data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]  # a file saved "UTF-8 with BOM": not part of row 1
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the chunk's last row
    parsed, rejects = [], []
    for i, raw in enumerate(lines):
        try:
            parsed.append((i, _parse_line(raw, cfg)))
        except Exception as e:  # any failure on one row rejects that row, never the run
            rejects.append((i, *reject_reason(e, "invalid_json"), raw))
    return len(lines), parsed, rejects, lines.__getitem__


def _columnar_rows(task: dict, cfg: Any):
    """As :func:`_jsonl_rows`, for a unit of Parquet row groups or Arrow record batches. A null
    is an absent key (what a missing key becomes when rows are written as columns)."""
    keys = read_columns(cfg) + image_columns(task["path"], cfg)
    cols = read_unit(task, keys)
    n = len(cols[keys[0]]) if keys else 0
    rows = [{k: cols[k][i] for k in keys} for i in range(n)]
    parsed, rejects = [], []
    for i, row in enumerate(rows):
        present = {k: (strip_nulls(v) if cfg.chat else v) for k, v in row.items() if v is not None}
        try:
            parsed.append((i, row_values(present, cfg, missing="no value in column {!r} (null)",
                                         surrogates=False)))  # valid UTF-8 holds no surrogate
        except Exception as e:
            rejects.append((i, *reject_reason(e, "wrong_type"), row_text(row)))
    return n, parsed, rejects, lambda i: row_text(rows[i])


def image_columns(path: str, cfg: Any) -> list[str]:
    """``["images"]`` for a chat file of an image run whose schema has that column."""
    if not cfg.chat or _worker.get("proc") is None:
        return []
    schemas = _worker.setdefault("schemas", {})
    if path not in schemas:
        schemas[path] = IMAGES_COLUMN in schema_names(path)
    return [IMAGES_COLUMN] if schemas[path] else []


def _read_range(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def _flatten(seqs: list, dtype, eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    if eod is not None:
        seqs = [itertools.chain(s, (eod,)) for s in seqs]
        lengths += 1
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    return flat.astype(dtype, copy=False), lengths


ENCODE_BATCH_CHARS = 1 << 20  # a fast tokenizer's batch holds ~100 bytes per token: keep it small


def _encode_rows(tok, texts: list[str]) -> tuple[list, dict]:
    """Encode in batches of about ``ENCODE_BATCH_CHARS`` characters (the tokenizer's transient
    memory stays bounded however large a unit is: a Parquet row group can be); where a batch call
    raises, encode its rows one by one so that only the rows that fail are lost. Returns the ids
    (None for a failed row) and {row: (reason, detail)}."""
    ids, failed, start = [], {}, 0
    while start < len(texts):
        end, chars = start, 0
        while end < len(texts) and (end == start or chars + len(texts[end]) <= ENCODE_BATCH_CHARS):
            chars += len(texts[end])
            end += 1
        try:
            ids += tok.encode_batch(texts[start:end])
        except Exception:
            for j in range(start, end):
                try:
                    ids.append(tok.encode(texts[j]))
                except Exception as e:
                    ids.append(None)
                    failed[j] = reject_reason(e, "tokenizer_error")
        start = end
    return ids, failed


def _encode_chats(out: dict, parsed: list, rejects: list, raw_of, tok, cfg, dtype, eod,
                  base_dir: str) -> None:
    ids, masks, images, index = [], [], [], []
    proc = _worker.get("proc")
    max_pixels = getattr(cfg, "max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)
    for i, (msgs, row_images) in parsed:
        try:
            t, m, imgs, runs = encode_image_chat(tok, proc, msgs, row_images, base_dir, max_pixels,
                                                 reasoning_loss=cfg.reasoning_loss,
                                                 mask_history=cfg.mask_history)
        except Exception as e:
            rejects.append((i, *reject_reason(e, "tokenizer_error"), raw_of(i)))
            continue
        ids.append(t)
        masks.append(m if eod is None else np.append(m, np.uint8(0)))
        images += imgs
        # one row per image: (run start, run length, width, height, CRC-32 of its bytes)
        index.append(np.column_stack([runs, np.array([(w, h, checksum(b)) for b, w, h in imgs],
                                                     np.int64).reshape(-1, 3)]).reshape(-1))
    out["text"] = _flatten(ids, dtype, eod)
    out["loss_mask"] = (np.concatenate(masks) if masks else np.zeros(0, np.uint8), out["text"][1])
    if proc is not None:
        out["images"] = (np.frombuffer(b"".join(b for b, _, _ in images), np.uint8),
                         np.array([len(b) for b, _, _ in images], np.int64))
        out["image_index"] = (np.concatenate(index) if index else np.zeros(0, np.int64),
                              np.array([len(x) for x in index], np.int64))


def _encode_texts(out: dict, parsed: list, rejects: list, raw_of, tok, cfg, dtype, eod) -> None:
    encoded, failed = [], {}
    for k_i in range(len(cfg.json_keys)):
        ids, bad = _encode_rows(tok, [v[k_i] for _, v in parsed])
        encoded.append(ids)
        for j, why in bad.items():
            failed.setdefault(j, why)
    for j, (reason, detail) in failed.items():  # a row failing on any key is rejected whole
        rejects.append((parsed[j][0], reason, detail, raw_of(parsed[j][0])))
    for key, ids in zip(cfg.json_keys, encoded):
        out[key] = _flatten([x for j, x in enumerate(ids) if j not in failed], dtype, eod)


def process_chunk(task) -> dict:
    """Encode the rows of one unit. Runs in a worker (or in-process with --workers 1)."""
    empty = {"n_lines": 0, "rejects": [], "n_bytes": task.get("n_bytes", 0)}
    if "file_error" in task:
        return {**empty, "file_error": task["file_error"]}
    cfg, tok, dtype = _worker["cfg"], _worker["tok"], _worker["dtype"]
    try:
        if "format" in task:
            n, parsed, rejects, raw_of = _columnar_rows(task, cfg)
        else:
            n, parsed, rejects, raw_of = _jsonl_rows(task, cfg)
    except read_errors() as e:  # a read error, or a damaged row group or record batch
        return {**empty, "file_error": _file_error(task, e)}
    out: dict = {"n_lines": n, "rejects": rejects, "row_numbers": "row" if "format" in task else "line",
                 "n_bytes": task["n_bytes"] if "format" in task else task["end"] - task["start"]}
    eod = tok.eod_id if cfg.append_eod else None
    if cfg.chat:
        _encode_chats(out, parsed, rejects, raw_of, tok, cfg, dtype, eod, os.path.dirname(task["path"]))
    else:
        _encode_texts(out, parsed, rejects, raw_of, tok, cfg, dtype, eod)
    rejects.sort(key=lambda r: r[0])
    return out


def _file_error(task: dict, e: Exception) -> str:
    if "format" in task:  # the parent names the file
        where = describe_unit(task).removeprefix(task["path"]).strip() or "it"
        return f"cannot read {where} ({one_line(e)})"
    return f"cannot read bytes {task['start']:,}-{task['end']:,}: {e}"
