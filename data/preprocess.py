"""JSONL text or chat rows -> tokenized indexed datasets, with every rejected row accounted for.

Work is split into chunks of whole lines. For a plain file a chunk is a byte range that the
worker reads itself, so the parent never touches the text: it only writes the token arrays that
come back, in input order. A ``.gz`` file cannot be seeked, so the parent decompresses and
ships the chunk's bytes. Rows are split on ``\\n`` only: a row whose strings hold U+2028,
U+2029 or a bare ``\\r`` is one row (``str.splitlines`` would cut it, silently losing data).
"""
from __future__ import annotations

import glob
import gzip
import itertools
import json
import multiprocessing as mp
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data.chat import RowError, encode_chat
from data.indexed_dataset import IndexedDatasetWriter, token_dtype
from data.tokenizers import build_tokenizer

REJECT_REASONS = ("blank_line", "invalid_utf8", "invalid_json", "not_an_object", "missing_key",
                  "wrong_type", "empty_text", "unknown_role", "no_assistant_turn", "template_error")


@dataclass
class PreprocessStats:
    rows_read: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    documents: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def summary(self) -> str:
        by_reason = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items())) or "none"
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return (f"rows read {self.rows_read:,}, accepted {self.accepted:,}, rejected "
                f"{self.num_rejected:,} ({by_reason}), documents {self.documents:,}, tokens "
                f"{self.tokens:,}, {self.seconds:.1f} s ({rate:,.0f} tokens/s)")


def expand_inputs(patterns: list[str]) -> list[str]:
    files: list[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else ([pat] if os.path.isfile(pat) else [])
        if not hits:
            raise FileNotFoundError(f"--input {pat!r}: no such file")
        files.extend(hits)
    return files


# ---------------------------------------------------------------------------------------------
# Workers: one chunk of lines -> token arrays and rejects
# ---------------------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(cfg: Any) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker process
    tok = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)
    _worker.update(cfg=cfg, tok=tok, dtype=token_dtype(tok.vocab_size))


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
        return row[cfg.chat]
    values = [row[k] for k in keys]
    for k, v in zip(keys, values):
        if not isinstance(v, str):
            raise RowError("wrong_type", f"{k!r} must be a string, got {type(v).__name__}")
        if not v.strip():
            raise RowError("empty_text", f"{k!r} is empty after stripping whitespace")
    return values


def _flatten(seqs: list, dtype, eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    if eod is not None:
        seqs = [itertools.chain(s, (eod,)) for s in seqs]
        lengths += 1
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    return flat.astype(dtype, copy=False), lengths


def process_chunk(task) -> dict:
    """Encode the rows of one chunk. Runs in a worker (or in-process with --workers 1)."""
    cfg, tok, dtype = _worker["cfg"], _worker["tok"], _worker["dtype"]
    data = task["data"] if "data" in task else _read_range(task["path"], task["start"], task["end"])
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the chunk's last row
    eod = tok.eod_id if cfg.append_eod else None
    rejects, parsed = [], []  # parsed: (line index, value) for rows that passed parsing
    for i, raw in enumerate(lines):
        try:
            parsed.append((i, _parse_row(raw, cfg)))
        except RowError as e:
            rejects.append((i, e.reason, e.detail, raw))
    out: dict = {"n_lines": len(lines), "rejects": rejects, "n_bytes": len(data)}
    if cfg.chat:
        ids, masks = [], []
        for i, msgs in parsed:
            try:
                t, m = encode_chat(tok, msgs)
            except RowError as e:
                rejects.append((i, e.reason, e.detail, lines[i]))
                continue
            ids.append(t)
            masks.append(m if eod is None else np.append(m, np.uint8(0)))
        out["text"] = _flatten(ids, dtype, eod)
        out["loss_mask"] = (np.concatenate(masks) if masks else np.zeros(0, np.uint8), out["text"][1])
        rejects.sort(key=lambda r: r[0])
    else:
        for k_i, key in enumerate(cfg.json_keys):
            out[key] = _flatten(tok.encode_batch([v[k_i] for _, v in parsed]), dtype, eod)
    return out


def _read_range(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


# ---------------------------------------------------------------------------------------------
# Parent: chunking, ordered writing, accounting
# ---------------------------------------------------------------------------------------------

def iter_chunks(path: str, chunk_bytes: int):
    """Chunks of whole lines: byte ranges for plain files, bytes for .gz files."""
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            rest = b""
            while True:
                block = f.read(chunk_bytes)
                if not block:
                    if rest:
                        yield {"data": rest}
                    return
                block = rest + block
                cut = block.rfind(b"\n") + 1
                rest = block[cut:]
                if cut:
                    yield {"data": block[:cut]}
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


class PreprocessError(RuntimeError):
    """The run finished reading but its result must not be published."""


def output_keys(cfg: Any) -> list[str]:
    return ["text"] if cfg.chat else list(cfg.json_keys)


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

    def imap(self, fn, tasks):
        return map(fn, tasks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _executor(cfg):
    if cfg.workers == 1:
        return _InProcess(cfg)
    # spawn: workers start clean (no inherited tokenizer threads or torch state)
    return mp.get_context("spawn").Pool(cfg.workers, initializer=_init_worker, initargs=(cfg,))


def run(cfg: Any, progress: bool = True) -> PreprocessStats:
    """Tokenize ``cfg.input`` into ``cfg.output_prefix`` datasets; returns the counts."""
    from tqdm import tqdm

    files = expand_inputs(cfg.input)
    tok = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)
    if cfg.append_eod and tok.eod_id < 0:
        raise ValueError("--append-eod: this tokenizer defines no end-of-document (EOS) token")
    dtype = token_dtype(tok.vocab_size)
    prefix = cfg.output_prefix
    writers = {k: IndexedDatasetWriter(f"{prefix}_{k}_document", dtype) for k in output_keys(cfg)}
    if cfg.chat:
        writers["loss_mask"] = IndexedDatasetWriter(f"{prefix}_loss_mask_document", np.uint8)
    rejects_path = f"{prefix}_rejects.jsonl"
    rejects_tmp = f"{rejects_path}.tmp-{os.getpid()}"
    stats = PreprocessStats()
    line_base = [0] * len(files)
    t0 = time.perf_counter()
    total = None if any(f.endswith(".gz") for f in files) else sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", disable=not progress)
    try:
        with open(rejects_tmp, "w", encoding="utf-8") as rej, _executor(cfg) as pool:
            last_log = 0
            for file_idx, res in pool.imap(_with_file_idx, _tasks(files, int(cfg.chunk_mb * 2**20))):
                for i, reason, detail, raw in res["rejects"]:
                    rej.write(json.dumps({"file": files[file_idx], "line": line_base[file_idx] + i + 1,
                                          "reason": reason, "detail": detail,
                                          "text": raw.decode("utf-8", "backslashreplace")},
                                         ensure_ascii=False) + "\n")
                    stats.rejected[reason] += 1
                line_base[file_idx] += res["n_lines"]
                stats.rows_read += res["n_lines"]
                n_docs = 0
                for key, w in writers.items():
                    flat, lengths = res[key]
                    w.add_many(flat, lengths)
                    n_docs = len(lengths)
                    if key != "loss_mask":
                        stats.tokens += flat.size
                stats.documents += n_docs
                bar.update(res["n_bytes"])
                if stats.rows_read - last_log >= cfg.log_interval:
                    last_log = stats.rows_read
                    bar.set_postfix(rows=stats.rows_read, rejected=stats.num_rejected,
                                    tok_s=f"{stats.tokens / (time.perf_counter() - t0):,.0f}")
        bar.close()
        stats.accepted = stats.rows_read - stats.num_rejected
        stats.seconds = time.perf_counter() - t0
        os.replace(rejects_tmp, rejects_path)  # published even on failure: it says what went wrong
        if stats.rows_read == 0:
            raise PreprocessError(f"no rows in {', '.join(files)}")
        frac = stats.num_rejected / stats.rows_read
        if frac > cfg.max_rejected_fraction:
            raise PreprocessError(
                f"{stats.num_rejected:,} of {stats.rows_read:,} rows rejected ({frac:.2%} > "
                f"--max-rejected-fraction {cfg.max_rejected_fraction:g}); see {rejects_path}. "
                "No dataset was written. Fix the input or raise --max-rejected-fraction.")
        for w in writers.values():
            w.finalize()
    except BaseException:
        bar.close()
        for w in writers.values():
            w.abort()
        if os.path.exists(rejects_tmp):
            os.remove(rejects_tmp)
        raise
    stats.accepted = stats.rows_read - stats.num_rejected
    return stats
