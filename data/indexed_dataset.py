"""Megatron-LM compatible indexed datasets (the ``MMIDIDX`` format), read and written.

A dataset is a pair of files sharing a prefix:

``PREFIX.idx`` (little-endian, no padding between fields)::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version (1)
    u8        dtype code (see DTYPE_CODES)
    u64       sequence count S
    u64       document count D (= documents + 1)
    int32[S]  sequence lengths, in elements
    int64[S]  byte offsets of each sequence in PREFIX.bin
    int64[D]  document indices [0, ..., S]

``PREFIX.bin``: every sequence's elements back to back in that dtype, no header.

We write one sequence per document, so the document indices are ``0..S``. The reader memory-maps
both files and validates the whole index at open, vectorised in blocks (O(S), about a second
for 100M sequences, see ``benchmarks/bench_index_open.py``): sizes are non-negative, each byte
offset is the running sum of the sizes before it times the item size, document indices lie in
``[0, S]``, never decrease and run from 0 to S, and the ``.bin`` holds exactly the bytes the
index describes. A truncated or corrupt file fails at open with a message naming the file and
the first bad entry, instead of crashing (or training on garbage) many iterations later.

The writer streams: lengths go to a growing numpy buffer, never a Python list, and the files are
written under temporary names and renamed on success, with a statistics sidecar
(``PREFIX.meta.json``, see ``data/dataset_stats.py``) recording the smallest and largest value
and the CRC-32 of every 1 MiB block of the ``.bin`` (``data/checksums.py``), which the training
loader checks as it reads.
:func:`publish_together` renames several datasets as one unit (all or none), and a write error
(a full disk) names the file it was writing.
"""
from __future__ import annotations

import os
import struct
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from data import dataset_stats
from data.checksums import BlockCRC

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
CHECK_BLOCK = 1 << 16  # index entries validated per step: temporaries stay in cache (3x
                       # faster than 4 Mi entries per step, see bench_index_open.py)

DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class DatasetError(ValueError):
    """A dataset that cannot be read as it is (a file missing or damaged, not published with the
    rest, or not trainable with the run's flags): the message names the file and what to do.
    ``pretrain_step37.py`` reports it in one line wherever it is found, at start-up or when the
    loader reads the damage mid-run."""


class IndexedDatasetError(DatasetError):
    """A dataset file is missing, truncated or does not follow the MMIDIDX layout."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with room to spare (Megatron's 65,500 rule), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.bin"


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code; "
                         f"use one of {sorted(str(np.dtype(v)) for v in DTYPE_CODES.values())}") from None


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.{idx,bin}``.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the memory map); ``ds.lengths``
    the int32 lengths of all sequences; ``ds.get(i, offset, length)`` a slice of one sequence.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                raise IndexedDatasetError(f"{p}: no such file (expected a dataset written by "
                                          "tools/preprocess_data.py or Megatron-LM)")
        idx_size = os.path.getsize(ipath)
        if idx_size < HEADER_SIZE:
            raise IndexedDatasetError(f"{ipath}: truncated header ({idx_size} bytes, "
                                      f"need at least {HEADER_SIZE})")
        with open(ipath, "rb") as f:
            header = f.read(HEADER_SIZE)
        if header[:9] != MAGIC:
            raise IndexedDatasetError(f"{ipath}: bad magic {header[:9]!r}, expected {MAGIC!r} "
                                      "(not an MMIDIDX index file)")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:])
        if version != VERSION:
            raise IndexedDatasetError(f"{ipath}: unsupported version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{ipath}: unknown dtype code {code}, "
                                      f"expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_size < expected:
            raise IndexedDatasetError(f"{ipath}: truncated: {idx_size} bytes, but the header "
                                      f"declares {n_seq} sequences and {n_doc} document entries "
                                      f"({expected} bytes)")
        self._idx = np.memmap(ipath, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.lengths = np.frombuffer(self._idx, np.int32, n_seq, off)
        off += n_seq * 4
        self.pointers = np.frombuffer(self._idx, np.int64, n_seq, off)
        off += n_seq * 8
        self.document_indices = np.frombuffer(self._idx, np.int64, n_doc, off)

        total = _check_sequences(ipath, self.lengths, self.pointers, self.dtype.itemsize)
        _check_documents(ipath, self.document_indices, n_seq)
        bin_size = os.path.getsize(bpath)
        if bin_size != total:
            raise IndexedDatasetError(f"{bpath}: {bin_size} bytes, but {ipath} describes "
                                      f"{total} bytes of {self.dtype} data (truncated or mismatched pair)")
        # An empty .bin cannot be memory-mapped; an empty array stands in for it.
        self._bin = (np.memmap(bpath, mode="r", dtype=self.dtype) if bin_size
                     else np.empty(0, dtype=self.dtype))
        self._verify = None  # VerifiedBlocks, once verify_with is called

    def verify_with(self, record: dict | None, now: bool = False) -> None:
        """Check every later ``get`` against the block checksums ``record`` (the sidecar's
        ``"checksums"``, ``data/checksums.py``; None: read unchecked), and with ``now`` the
        whole ``.bin`` at once (a small file read whole anyway)."""
        from data.checksums import VerifiedBlocks

        self._verify = None if record is None else \
            VerifiedBlocks(bin_path(self.prefix), self._bin, self.pointers, record)
        if now and self._verify is not None:
            self._verify.check(0, self._bin.nbytes)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {self.prefix} ({len(self)} sequences)")
        n = int(self.lengths[i])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {i} of length {n}")
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        if self._verify is not None:
            size = self.dtype.itemsize
            self._verify.check(start * size, (start + length) * size)
        return self._bin[start:start + length]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))


def _check_sequences(ipath: str, lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> int:
    """Sizes >= 0 and ``pointers[i] == itemsize * sum(lengths[:i])`` for every i, checked in
    blocks as ``pointers[0] == 0`` and ``diff(pointers) == itemsize * lengths[:-1]`` (the
    cheapest exact form); returns the byte size of the data."""
    n = len(lengths)
    if n == 0:
        return 0
    if pointers[0] != 0:
        _bad_pointer(ipath, 0, int(pointers[0]), 0, itemsize)
    for a in range(0, n, CHECK_BLOCK):
        size = lengths[a:a + CHECK_BLOCK]
        if size.min() < 0:
            i = a + int(np.argmax(size < 0))
            raise IndexedDatasetError(f"{ipath}: sequence {i} has a negative size {int(lengths[i])} "
                                      "(corrupt index)")
        step = np.diff(pointers[a:a + CHECK_BLOCK + 1])  # one entry of overlap with the next block
        want = size[:len(step)].astype(np.int64)
        want *= itemsize
        if not np.array_equal(step, want):
            # pointers[a] is right (checked by the block before), so the running sum from it
            # names the first wrong entry
            starts = np.cumsum(want) + int(pointers[a])
            j = int(np.argmax(pointers[a + 1:a + 1 + len(step)] != starts))
            _bad_pointer(ipath, a + j + 1, int(pointers[a + j + 1]), int(starts[j]), itemsize)
    return int(pointers[-1]) + int(lengths[-1]) * itemsize


def _bad_pointer(ipath: str, i: int, got: int, want: int, itemsize: int) -> None:
    raise IndexedDatasetError(
        f"{ipath}: sequence {i} starts at byte {got}, but the sizes before it add up to {want} "
        f"bytes ({want // itemsize} elements of {itemsize} bytes): the sizes or the offsets are "
        f"corrupt (first bad entry: sequence {i})")


def _check_documents(ipath: str, docs: np.ndarray, n_seq: int) -> None:
    """Document indices (sequence numbers where documents start) in [0, S], non-decreasing,
    from 0 to S (Megatron-LM writes them so; an empty document repeats an index)."""
    if docs.size == 0:
        raise IndexedDatasetError(f"{ipath}: no document indices (expected at least [0, {n_seq}])")
    for a in range(0, len(docs), CHECK_BLOCK):
        block = docs[a:a + CHECK_BLOCK + 1]  # one entry of overlap, to compare across blocks
        # non-decreasing, so the ends bound the block: one comparison pass on the fast path
        if block[0] < 0 or block[-1] > n_seq or not (block[1:] >= block[:-1]).all():
            _name_bad_document(ipath, docs, n_seq)
    if docs[0] != 0 or docs[-1] != n_seq:
        i, v = (0, docs[0]) if docs[0] != 0 else (len(docs) - 1, docs[-1])
        raise IndexedDatasetError(f"{ipath}: document index entry {i} is {int(v)}; document "
                                  f"indices must run from 0 to {n_seq}")


def _name_bad_document(ipath: str, docs: np.ndarray, n_seq: int) -> None:
    """The first entry out of range or smaller than the one before it (slow path, errors only)."""
    out = np.flatnonzero((docs < 0) | (docs > n_seq))
    down = np.flatnonzero(docs[1:] < docs[:-1]) + 1
    if out.size and (not down.size or out[0] < down[0]):
        i = int(out[0])
        raise IndexedDatasetError(f"{ipath}: document index entry {i} is {int(docs[i])}, "
                                  f"outside [0, {n_seq}] (the number of sequences)")
    i = int(down[0])
    raise IndexedDatasetError(f"{ipath}: document index entry {i} is {int(docs[i])}, smaller than "
                              f"entry {i - 1} ({int(docs[i - 1])}): document indices must never "
                              "decrease")


@contextmanager
def names_file(path: str):
    """An ``OSError`` raised inside (a full disk, a quota) names ``path`` when it does not
    name a file already: Python's ``write`` and ``close`` errors name none."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


class IndexedDatasetWriter:
    """Streams sequences to ``PREFIX.{bin,idx}`` under temporary names.

    Use as a context manager: leaving the block normally publishes both files (``.bin`` renamed
    first, ``.idx`` last, so a complete-looking pair always is complete); an exception, including
    ``KeyboardInterrupt``, deletes the temporaries and leaves no final-named file behind.
    """

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = bin_path(prefix) + tag
        self._idx_tmp = idx_path(prefix) + tag
        self._meta_tmp = self.prefix + dataset_stats.SUFFIX + tag
        Path(self._bin_tmp).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = np.empty(1024, dtype=np.int32)
        self._count = 0
        self._stats = dataset_stats.empty_stats()
        self._blocks = BlockCRC()
        self._done = False
        self._published: list[str] = []

    def add(self, seq: np.ndarray) -> None:
        """Append one sequence."""
        seq = np.asarray(seq)
        self.add_many(seq, np.array([seq.size], dtype=np.int64))

    def add_many(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append ``len(lengths)`` sequences stored back to back in ``flat``."""
        flat = np.ascontiguousarray(flat)
        if flat.dtype != self.dtype:
            if self.dtype.kind in "iu" and flat.size:
                info = np.iinfo(self.dtype)
                if flat.min() < info.min or flat.max() > info.max:
                    raise ValueError(f"{self.prefix}: values outside {self.dtype}'s range "
                                     f"[{info.min}, {info.max}]")
            flat = flat.astype(self.dtype)
        lengths = np.asarray(lengths)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {flat.size} elements were given")
        if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2^31-1 elements cannot be indexed")
        need = self._count + lengths.size
        if need > self._lengths.size:
            grown = np.empty(max(need, 2 * self._lengths.size), dtype=np.int32)
            grown[:self._count] = self._lengths[:self._count]
            self._lengths = grown
        self._lengths[self._count:need] = lengths
        self._count = need
        starts = np.cumsum(lengths) - lengths
        self._stats = dataset_stats.merge(self._stats,
                                          dataset_stats.block_stats(flat, starts[lengths > 0]))
        data = flat.tobytes()
        self._blocks.update(data)
        with names_file(self._bin_tmp):
            self._bin.write(data)

    def _write_index(self) -> None:
        lengths = self._lengths[:self._count]
        pointers = np.zeros(self._count, dtype=np.int64)
        if self._count > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(self._count + 1, dtype=np.int64)
        with names_file(self._idx_tmp), open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, self._code, self._count, doc_idx.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())

    def finalize(self, meta: dict | None = None) -> None:
        """Write the index and the statistics sidecar (with ``meta`` added, e.g. the tokenizer)
        and publish all three under their final names, the sidecar last."""
        self.prepare(meta)
        self.commit()

    def prepare(self, meta: dict | None = None) -> None:
        """Write the index and the sidecar under their temporary names (nothing published)."""
        with names_file(self._bin_tmp):
            self._bin.close()
        self._write_index()
        # renaming keeps sizes and modification times, so the identity of the temporaries is
        # the identity of the published pair
        ident = dataset_stats.identity(self._bin_tmp, self._idx_tmp)
        meta = {**(meta or {}), "checksums": self._blocks.record()}
        with names_file(self._meta_tmp), open(self._meta_tmp, "wb") as f:
            f.write(dataset_stats.sidecar_bytes(self._stats, ident, meta))

    def commit(self) -> None:
        """Publish what ``prepare`` wrote: ``.bin``, then ``.idx``, then the sidecar."""
        finals = (bin_path(self.prefix), idx_path(self.prefix), self.prefix + dataset_stats.SUFFIX)
        for tmp, final in zip((self._bin_tmp, self._idx_tmp, self._meta_tmp), finals):
            with names_file(final):
                os.replace(tmp, final)
            self._published.append(final)
        self._done = True

    def unpublish(self) -> None:
        """Remove what ``commit`` published (one dataset of a unit that failed to publish)."""
        for p in self._published:
            if os.path.exists(p):
                os.remove(p)
        self._published, self._done = [], False

    def abort(self) -> None:
        """Discard everything written so far (a second error while closing is ignored: the
        first one is what the caller reports)."""
        if not self._bin.closed:
            try:
                self._bin.close()
            except OSError:
                pass
        for p in (self._bin_tmp, self._idx_tmp, self._meta_tmp):
            if os.path.exists(p):
                os.remove(p)

    def __len__(self) -> int:
        return self._count

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._done:
            self.finalize()
        elif exc_type is not None:
            self.abort()


def publish_together(writers: list["IndexedDatasetWriter"], meta: dict | None = None) -> None:
    """Publish several datasets as one unit (a chat dataset's text and loss mask): every one is
    prepared (index, sidecar) before any is renamed, and when a rename fails the ones already
    renamed are removed, so the unit appears whole or not at all. The temporaries of the rest
    stay for the caller's ``abort``."""
    for w in writers:
        w.prepare(meta)
    try:
        for w in writers:
            w.commit()
    except BaseException:
        for w in writers:
            w.unpublish()
        raise


class InMemoryDataset:
    """Documents held in memory behind the reader's ``get(i, offset, length)`` (tests, benchmarks,
    synthetic data)."""

    def __init__(self, docs: list):
        self.docs = [np.asarray(d) for d in docs]

    def __len__(self) -> int:
        return len(self.docs)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        d = self.docs[i]
        return d[offset:len(d) if length is None else offset + length]
