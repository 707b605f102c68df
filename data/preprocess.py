"""JSONL text or chat rows -> tokenized indexed datasets, with every rejected row accounted for.

Work is split into chunks of whole lines (``data/input_chunks.py``): byte ranges that workers
read themselves, so the parent never touches the text and only writes the token arrays that
come back, in input order (decompressed bytes for ``.gz`` files). Rows are split on ``\\n``
only: a row whose strings hold U+2028, U+2029 or a bare ``\\r`` is one row
(``str.splitlines`` would cut it, silently losing data).

Failures are sorted by what they spoil. Anything wrong with one row (bad JSON or UTF-8, a lone
surrogate escape, nesting deeper than the JSON parser's recursion limit, an exception from the
tokenizer or chat template) rejects that row with a reason, file and line. Anything wrong with
a file (a truncated or invalid gzip stream, a read error) stops the run naming the file and the
rows read from it. A worker that dies stops the run naming the input range it held
(``data/workers.py``). Temporary outputs are removed on every failure, Ctrl-C and SIGTERM.
"""
from __future__ import annotations

import codecs
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.chat import SURROGATE, RowError, encode_chat
from data.indexed_dataset import IndexedDatasetWriter, names_file, publish_together, token_dtype
from data.input_chunks import describe_task, iter_chunks
from data.input_files import expand_inputs
from data.tokenizers import build_tokenizer
from data.units import new_unit
from data.workers import OrderedPool

REJECT_REASONS = ("blank_line", "invalid_utf8", "invalid_unicode", "invalid_json", "too_deep",
                  "not_an_object", "missing_key", "wrong_type", "empty_text", "unknown_role",
                  "no_assistant_turn", "invalid_tool_call", "tool_calls_unsupported",
                  "template_error", "tokenizer_error")


@dataclass
class PreprocessStats:
    rows_read: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    documents: int = 0
    tokens: int = 0
    seconds: float = 0.0
    notes: list = field(default_factory=list)  # inputs left out or read once, said before the run
    removed: list = field(default_factory=list)  # stale outputs of an earlier run, removed

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def summary(self) -> str:
        by_reason = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items())) or "none"
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return (f"rows read {self.rows_read:,}, accepted {self.accepted:,}, rejected "
                f"{self.num_rejected:,} ({by_reason}), documents {self.documents:,}, tokens "
                f"{self.tokens:,}, {self.seconds:.1f} s ({rate:,.0f} tokens/s)")


# ---------------------------------------------------------------------------------------------
# Workers: one chunk of lines -> token arrays and rejects
# ---------------------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(cfg: Any) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker process
    tok = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)
    _worker.update(cfg=cfg, tok=tok, dtype=token_dtype(tok.vocab_size))


def _reject_reason(exc: Exception, default: str) -> tuple[str, str]:
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


def _parse_row(raw: bytes, cfg: Any):
    """Bytes of one line -> the values to tokenize, or RowError."""
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
    keys = [cfg.chat] if cfg.chat else cfg.json_keys
    for k in keys:
        if k not in row:
            raise RowError("missing_key", f"no key {k!r}")
    if cfg.chat:
        return row[cfg.chat]  # encode_chat checks the rendered text for lone surrogates
    values = [row[k] for k in keys]
    for k, v in zip(keys, values):
        if not isinstance(v, str):
            raise RowError("wrong_type", f"{k!r} must be a string, got {type(v).__name__}")
        if not v.strip():
            raise RowError("empty_text", f"{k!r} is empty after stripping whitespace")
        if b"\\u" in raw:  # only a \\u escape can produce a surrogate in valid UTF-8 input
            _check_unicode(k, v)
    return values


def _flatten(seqs: list, dtype, eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    if eod is not None:
        seqs = [itertools.chain(s, (eod,)) for s in seqs]
        lengths += 1
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    return flat.astype(dtype, copy=False), lengths


def _encode_rows(tok, texts: list[str]) -> tuple[list, dict]:
    """Encode a batch; if the batch call raises, encode row by row so that only the rows that
    fail are lost. Returns the ids (None for a failed row) and {row: (reason, detail)}."""
    try:
        return tok.encode_batch(texts), {}
    except Exception:
        pass
    ids, failed = [], {}
    for j, t in enumerate(texts):
        try:
            ids.append(tok.encode(t))
        except Exception as e:
            ids.append(None)
            failed[j] = _reject_reason(e, "tokenizer_error")
    return ids, failed


def process_chunk(task) -> dict:
    """Encode the rows of one chunk. Runs in a worker (or in-process with --workers 1)."""
    if "file_error" in task:
        return {"file_error": task["file_error"], "n_lines": 0, "n_bytes": 0, "rejects": []}
    cfg, tok, dtype = _worker["cfg"], _worker["tok"], _worker["dtype"]
    data = task.get("data")
    if data is None:
        try:
            data = _read_range(task["path"], task["start"], task["end"])
        except OSError as e:
            return {"file_error": f"cannot read bytes {task['start']:,}-{task['end']:,}: {e}",
                    "n_lines": 0, "n_bytes": 0, "rejects": []}
    n_bytes = len(data)
    if task["start"] == 0 and data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]  # a file saved "UTF-8 with BOM": not part of row 1
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the chunk's last row
    eod = tok.eod_id if cfg.append_eod else None
    rejects, parsed = [], []  # parsed: (line index, value) for rows that passed parsing
    for i, raw in enumerate(lines):
        try:
            parsed.append((i, _parse_row(raw, cfg)))
        except Exception as e:  # any failure on one row rejects that row, never the run
            rejects.append((i, *_reject_reason(e, "invalid_json"), raw))
    out: dict = {"n_lines": len(lines), "rejects": rejects, "n_bytes": n_bytes}
    if cfg.chat:
        ids, masks = [], []
        for i, msgs in parsed:
            try:
                t, m = encode_chat(tok, msgs)
            except Exception as e:
                rejects.append((i, *_reject_reason(e, "tokenizer_error"), lines[i]))
                continue
            ids.append(t)
            masks.append(m if eod is None else np.append(m, np.uint8(0)))
        out["text"] = _flatten(ids, dtype, eod)
        out["loss_mask"] = (np.concatenate(masks) if masks else np.zeros(0, np.uint8), out["text"][1])
    else:
        encoded, failed = [], {}
        for k_i, key in enumerate(cfg.json_keys):
            ids, bad = _encode_rows(tok, [v[k_i] for _, v in parsed])
            encoded.append(ids)
            for j, why in bad.items():
                failed.setdefault(j, why)
        for j, (reason, detail) in failed.items():  # a row failing on any key is rejected whole
            rejects.append((parsed[j][0], reason, detail, lines[parsed[j][0]]))
        for key, ids in zip(cfg.json_keys, encoded):
            out[key] = _flatten([x for j, x in enumerate(ids) if j not in failed], dtype, eod)
    rejects.sort(key=lambda r: r[0])
    return out


def _read_range(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


# ---------------------------------------------------------------------------------------------
# Parent: chunking, ordered writing, accounting
# ---------------------------------------------------------------------------------------------

class PreprocessError(RuntimeError):
    """The run's result must not be published (too many rejects, a damaged input file)."""


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no ``except Exception``
    on the way (a row's rejection, say) swallows it and the run unwinds, removing its files."""


@contextmanager
def _sigterm_unwinds():
    """While preprocessing, SIGTERM raises :class:`Terminated` (in the main thread only, where
    Python delivers signals); a second SIGTERM during the unwinding is ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated("stopped by SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def output_keys(cfg: Any) -> list[str]:
    return ["text"] if cfg.chat else list(cfg.json_keys)


def written_keys(cfg: Any) -> list[str]:
    """Every dataset key the run publishes: the text keys, and the chat loss mask."""
    return output_keys(cfg) + (["loss_mask"] if cfg.chat else [])


def _tasks(files: list[str], chunk_bytes: int):
    for file_idx, path in enumerate(files):
        for task in iter_chunks(path, chunk_bytes):
            task["file_idx"] = file_idx
            yield task


def _with_file_idx(task: dict) -> tuple[int, dict]:
    return task["file_idx"], process_chunk(task)


class _InProcess:
    """--workers 1: the same code path without a pool (and without pickling)."""

    def __init__(self, cfg):
        _init_worker(cfg)

    def imap(self, tasks):
        return map(_with_file_idx, tasks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _executor(cfg):
    if cfg.workers == 1:
        return _InProcess(cfg)
    # spawn: workers start clean (no inherited tokenizer threads or torch state)
    return OrderedPool(cfg.workers, _with_file_idx, _init_worker, (cfg,), describe=describe_task)


class _Outputs:
    """The datasets and rejects file of one run, under temporary names until ``publish``."""

    def __init__(self, cfg, files: list[str], tok):
        prefix = cfg.output_prefix
        dtype = token_dtype(tok.vocab_size)
        self.files, self.stats = files, PreprocessStats()
        self.line_base = [0] * len(files)
        # the unit (data/units.py): training pairs a text with a loss mask only of its own run
        self.meta = {"tokenizer": {"type": cfg.tokenizer_type, "model": cfg.tokenizer_model,
                                   "vocab_size": tok.vocab_size}, "unit": new_unit(written_keys(cfg))}
        text_only = not cfg.chat and "text" in cfg.json_keys
        self.stale_mask = f"{prefix}_loss_mask_document" if text_only else None
        self.writers = {k: IndexedDatasetWriter(f"{prefix}_{k}_document", dtype) for k in output_keys(cfg)}
        if cfg.chat:
            self.writers["loss_mask"] = IndexedDatasetWriter(f"{prefix}_loss_mask_document", np.uint8)
        self.rejects_path = f"{prefix}_rejects.jsonl"
        self.rejects_tmp = f"{self.rejects_path}.tmp-{os.getpid()}"
        # a detail may quote a lone surrogate: escape it rather than fail the whole run
        self.rej = open(self.rejects_tmp, "w", encoding="utf-8", errors="backslashreplace")

    def add(self, file_idx: int, res: dict) -> None:
        path, stats = self.files[file_idx], self.stats
        if "file_error" in res:
            raise PreprocessError(
                f"{path}: {res['file_error']}, after {self.line_base[file_idx]:,} complete rows "
                "of this file. No dataset was written; repair or remove the file.")
        for i, reason, detail, raw in res["rejects"]:
            with names_file(self.rejects_tmp):
                self.rej.write(json.dumps({"file": path, "line": self.line_base[file_idx] + i + 1,
                                           "reason": reason, "detail": detail,
                                           "text": raw.decode("utf-8", "backslashreplace")},
                                          ensure_ascii=False) + "\n")
            stats.rejected[reason] += 1
        self.line_base[file_idx] += res["n_lines"]
        stats.rows_read += res["n_lines"]
        for key, w in self.writers.items():
            flat, lengths = res[key]
            w.add_many(flat, lengths)
            if key != "loss_mask":
                stats.tokens += flat.size
        stats.documents += len(lengths)

    def publish(self, max_rejected_fraction: float) -> None:
        stats = self.stats
        stats.accepted = stats.rows_read - stats.num_rejected
        with names_file(self.rejects_tmp):
            self.rej.close()
        os.replace(self.rejects_tmp, self.rejects_path)  # published even on failure: it says why
        if stats.rows_read == 0:
            raise PreprocessError(f"no rows in {', '.join(self.files)}")
        frac = stats.num_rejected / stats.rows_read
        if frac > max_rejected_fraction:
            raise PreprocessError(
                f"{stats.num_rejected:,} of {stats.rows_read:,} rows rejected ({frac:.2%} > "
                f"--max-rejected-fraction {max_rejected_fraction:g}); see {self.rejects_path}. "
                "No dataset was written. Fix the input or raise --max-rejected-fraction.")
        publish_together(list(self.writers.values()), self.meta)  # all or none
        self._remove_stale_mask()

    def _remove_stale_mask(self) -> None:
        """A text dataset published without --chat over an earlier chat dataset: the earlier
        loss mask beside it is not this text's (training would refuse the pair); remove it."""
        if self.stale_mask and os.path.exists(self.stale_mask + ".idx"):
            for ext in (".idx", ".bin", ".meta.json"):
                if os.path.exists(self.stale_mask + ext):
                    os.remove(self.stale_mask + ext)
            self.stats.removed.append(f"{self.stale_mask} (the loss mask of an earlier --chat run "
                                      "at this prefix; this text dataset has none)")

    def abort(self) -> None:
        try:
            self.rej.close()
        except OSError:
            pass  # a full disk: the first error is the one reported
        for w in self.writers.values():
            w.abort()
        if os.path.exists(self.rejects_tmp):
            os.remove(self.rejects_tmp)


def run(cfg: Any, progress: bool = True) -> PreprocessStats:
    """Tokenize ``cfg.input`` into ``cfg.output_prefix`` datasets; returns the counts.

    Raises PreprocessError (nothing published but the rejects file), WorkerDied, Terminated
    (SIGTERM) or KeyboardInterrupt; every temporary file is gone when any of them propagates.
    """
    from tqdm import tqdm

    files, notes = expand_inputs(cfg.input, cfg.output_prefix, written_keys(cfg))
    for note in notes if progress else ():
        print(f"preprocess_data: {note}", file=sys.stderr)
    tok = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)
    if cfg.append_eod and tok.eod_id < 0:
        raise ValueError("--append-eod: this tokenizer defines no end-of-document (EOS) token")
    t0 = time.perf_counter()
    total = None if any(f.endswith(".gz") for f in files) else sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", disable=not progress)
    with _sigterm_unwinds():
        out = _Outputs(cfg, files, tok)
        stats = out.stats
        stats.notes = notes
        try:
            with _executor(cfg) as pool:
                last_log = 0
                for file_idx, res in pool.imap(_tasks(files, int(cfg.chunk_mb * 2**20))):
                    out.add(file_idx, res)
                    bar.update(res["n_bytes"])
                    if stats.rows_read - last_log >= cfg.log_interval:
                        last_log = stats.rows_read
                        bar.set_postfix(rows=stats.rows_read, rejected=stats.num_rejected,
                                        tok_s=f"{stats.tokens / (time.perf_counter() - t0):,.0f}")
            bar.close()
            stats.seconds = time.perf_counter() - t0
            out.publish(cfg.max_rejected_fraction)
        except BaseException:
            bar.close()
            out.abort()
            raise
    return stats
