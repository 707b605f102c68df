"""Text or chat rows (JSONL, Parquet, Arrow) -> tokenized indexed datasets, with every rejected
row accounted for.

Work is split into units that workers read themselves, so the parent never touches the text and
only writes the token arrays that come back, in input order: chunks of whole JSONL lines
(``data/input_chunks.py``; decompressed bytes for ``.gz`` files) and runs of Parquet row groups
or Arrow record batches (``data/columnar.py``); ``data/preprocess_worker.py`` turns a unit into
tokens. JSONL rows are split on ``\\n`` only: a row whose strings hold U+2028, U+2029 or a bare
``\\r`` is one row (``str.splitlines`` would cut it, silently losing data).

Failures are sorted by what they spoil. Anything wrong with one row (bad JSON or UTF-8, a lone
surrogate escape, nesting deeper than the JSON parser's recursion limit, an exception from the
tokenizer or chat template) rejects that row with a reason, file and line. Anything wrong with
a file (a truncated or invalid gzip stream, a read error) stops the run naming the file and the
rows read from it. A worker that dies stops the run naming the input range it held
(``data/workers.py``). Temporary outputs are removed on every failure, Ctrl-C and SIGTERM.
"""
from __future__ import annotations

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

from data.columnar import check_columns, describe_unit, input_format, iter_units, schema_names
from data.images import INDEX_COLUMNS
from data.indexed_dataset import IndexedDatasetWriter, names_file, publish_together, token_dtype
from data.input_chunks import describe_task, iter_chunks
from data.input_files import expand_inputs
from data.preprocess_worker import init_worker, process_chunk, read_columns
from data.tokenizers import build_tokenizer
from data.units import new_unit
from data.workers import OrderedPool

REJECT_REASONS = ("blank_line", "invalid_utf8", "invalid_unicode", "invalid_json", "too_deep",
                  "not_an_object", "missing_key", "wrong_type", "empty_text", "unknown_role",
                  "no_assistant_turn", "invalid_tool_call", "tool_calls_unsupported", "system_unsupported",
                  "reasoning_unsupported", "template_error", "tokenizer_error",
                  # image + text rows (data/images.py, data/image_chat.py)
                  "image_unreadable", "image_empty", "image_too_large", "image_url",
                  "image_placement", "image_in_assistant", "images_unsupported")
IMAGE_DATASETS = ["images", "image_index"]  # the datasets an image run adds (data/image_store.py)


@dataclass
class PreprocessStats:
    rows_read: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    documents: int = 0
    tokens: int = 0
    images: int | None = None  # an image run's images (None: a text-only run)
    image_tokens: int = 0      # tokens of their placeholder runs (markers included)
    seconds: float = 0.0
    notes: list = field(default_factory=list)  # inputs left out or read once, said before the run
    removed: list = field(default_factory=list)  # stale outputs of an earlier run, removed

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def summary(self) -> str:
        by_reason = ", ".join(f"{k}: {v}" for k, v in sorted(self.rejected.items())) or "none"
        rate = self.tokens / self.seconds if self.seconds else 0.0
        images = "" if self.images is None else \
            f", images {self.images:,} ({self.image_tokens:,} image tokens)"
        return (f"rows read {self.rows_read:,}, accepted {self.accepted:,}, rejected "
                f"{self.num_rejected:,} ({by_reason}), documents {self.documents:,}, tokens "
                f"{self.tokens:,}{images}, {self.seconds:.1f} s ({rate:,.0f} tokens/s)")


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


def written_keys(cfg: Any, images: bool = False) -> list[str]:
    """Every dataset key the run publishes: the text keys, the chat loss mask, and with an image
    processor the images and their index."""
    return output_keys(cfg) + (["loss_mask"] if cfg.chat else []) + \
        (IMAGE_DATASETS if images and cfg.chat else [])


def _tasks(files: list[str], chunk_bytes: int, columns: list[str], images: bool = False):
    for file_idx, path in enumerate(files):
        # an image column counts in a unit's size: its bytes are most of the row
        extra = ["images"] if images and input_format(path) != "jsonl" and \
            "images" in schema_names(path) else []
        units = iter_chunks(path, chunk_bytes) if input_format(path) == "jsonl" else \
            iter_units(path, chunk_bytes, columns + extra)
        for task in units:
            task["file_idx"] = file_idx
            yield task


def _describe(task: dict) -> str:
    return describe_unit(task) if "format" in task else describe_task(task)


def check_inputs(files: list[str], cfg) -> None:
    """Every column the run reads is in every Parquet / Arrow input (``ValueError`` before any
    work otherwise); JSONL rows are checked one by one."""
    flag = f"--chat {cfg.chat}" if cfg.chat else f"--json-keys {' '.join(cfg.json_keys)}"
    for path in files:
        if input_format(path) != "jsonl":
            check_columns(path, read_columns(cfg), flag)


def _with_file_idx(task: dict) -> tuple[int, dict]:  # process_chunk looked up here: tests patch it
    return task["file_idx"], process_chunk(task)


class _InProcess:
    """--workers 1: the same code path without a pool (and without pickling)."""

    def __init__(self, cfg, image_processor=None):
        init_worker(cfg, image_processor)

    def imap(self, tasks):
        return map(_with_file_idx, tasks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _executor(cfg, image_processor=None):
    if cfg.workers == 1:
        return _InProcess(cfg, image_processor)
    # spawn: workers start clean (no inherited tokenizer threads or torch state)
    return OrderedPool(cfg.workers, _with_file_idx, init_worker, (cfg, image_processor),
                       describe=_describe)


class _Outputs:
    """The datasets and rejects file of one run, under temporary names until ``publish``."""

    def __init__(self, cfg, files: list[str], tok, proc=None):
        prefix = cfg.output_prefix
        dtype = token_dtype(tok.vocab_size)
        self.files, self.stats = files, PreprocessStats()
        self.line_base = [0] * len(files)
        images = proc is not None and bool(cfg.chat)
        # the unit (data/units.py): training pairs a text with a loss mask only of its own run
        self.meta = {"tokenizer": {"type": cfg.tokenizer_type, "model": cfg.tokenizer_model,
                                   "vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint()},
                     "unit": new_unit(written_keys(cfg, images))}
        if images:  # what the loader rebuilds the processor from (data/image_store.py)
            self.meta["images"] = {"processor": proc.settings, "token_ids": proc.token_ids,
                                   "image_token_id": proc.image_token_id, "checksum": "crc32"}
            self.stats.images = 0
        text_only = not cfg.chat and "text" in cfg.json_keys
        self.stale_mask = f"{prefix}_loss_mask_document" if text_only else None
        self.writers = {k: IndexedDatasetWriter(f"{prefix}_{k}_document", dtype) for k in output_keys(cfg)}
        self.text_keys = list(self.writers)
        if cfg.chat:
            self.writers["loss_mask"] = IndexedDatasetWriter(f"{prefix}_loss_mask_document", np.uint8)
        if images:
            self.writers["images"] = IndexedDatasetWriter(f"{prefix}_images_document", np.uint8)
            self.writers["image_index"] = IndexedDatasetWriter(f"{prefix}_image_index_document",
                                                               np.int64)
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
        # JSONL: "line", 1-based; Parquet / Arrow: "row", 0-based (as pyarrow and datasets count)
        by_line = res.get("row_numbers", "line") == "line"
        for i, reason, detail, raw in res["rejects"]:
            with names_file(self.rejects_tmp):
                self.rej.write(json.dumps({"file": path, ("line" if by_line else "row"):
                                           self.line_base[file_idx] + i + by_line,
                                           "reason": reason, "detail": detail,
                                           "text": raw if isinstance(raw, str) else
                                           raw.decode("utf-8", "backslashreplace")},
                                          ensure_ascii=False) + "\n")
            stats.rejected[reason] += 1
        self.line_base[file_idx] += res["n_lines"]
        stats.rows_read += res["n_lines"]
        for key, w in self.writers.items():
            flat, lengths = res[key]
            w.add_many(flat, lengths)
            if key in self.text_keys:
                stats.tokens += flat.size
        stats.documents += len(res[next(iter(self.text_keys))][1])
        if stats.images is not None:
            stats.images += len(res["images"][1])
            stats.image_tokens += int(res["image_index"][0].reshape(-1, INDEX_COLUMNS)[:, 1].sum())

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


def run(cfg: Any, progress: bool = True, image_processor=None) -> PreprocessStats:
    """Tokenize ``cfg.input`` into ``cfg.output_prefix`` datasets; returns the counts.

    ``image_processor``: a picklable factory ``token_id -> ImageProcessor`` (``data/images.py``;
    ``tools/preprocess_data.py`` makes it from the tokenizer folder): chat rows may then hold
    images, written to ``PREFIX_images_document`` with ``PREFIX_image_index_document``.

    Raises PreprocessError (nothing published but the rejects file), WorkerDied, Terminated
    (SIGTERM) or KeyboardInterrupt; every temporary file is gone when any of them propagates.
    """
    from tqdm import tqdm

    images = image_processor is not None and bool(cfg.chat)
    files, notes = expand_inputs(cfg.input, cfg.output_prefix, written_keys(cfg, images))
    check_inputs(files, cfg)
    for note in notes if progress else ():
        print(f"preprocess_data: {note}", file=sys.stderr)
    tok = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model)
    proc = image_processor(tok.token_id) if images else None
    if cfg.append_eod and tok.eod_id < 0:
        raise ValueError("--append-eod: this tokenizer defines no end-of-document (EOS) token")
    t0 = time.perf_counter()
    total = None if any(f.endswith(".gz") for f in files) else sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", disable=not progress)
    with _sigterm_unwinds():
        out = _Outputs(cfg, files, tok, proc)
        stats = out.stats
        stats.notes = notes
        try:
            with _executor(cfg, image_processor if images else None) as pool:
                last_log = 0
                for file_idx, res in pool.imap(_tasks(files, int(cfg.chunk_mb * 2**20),
                                                      read_columns(cfg), images)):
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
