"""MMIDIDX reader/writer: round trips, a golden file built by hand, named errors."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from data.indexed_dataset import (DTYPE_CODES, IndexedDataset, IndexedDatasetError,
                                  IndexedDatasetWriter, token_dtype)


def _write(prefix, seqs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for s in seqs:
            w.add(np.asarray(s, dtype=dtype))


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPE_CODES[code])
    rng = np.random.default_rng(code)
    seqs = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 0, 17, 1, 300)]
    _write(tmp_path / "d", seqs, dtype)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == dtype and len(ds) == len(seqs)
    for a, b in zip(seqs, (ds[i] for i in range(len(ds)))):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ds.get(4, offset=10, length=7), seqs[4][10:17])
    assert ds.num_tokens == sum(len(s) for s in seqs)


def test_add_many_equals_add(tmp_path):
    seqs = [np.arange(n, dtype=np.uint16) for n in (3, 4, 0, 9)]
    _write(tmp_path / "a", seqs, np.uint16)
    with IndexedDatasetWriter(tmp_path / "b", np.uint16) as w:
        w.add_many(np.concatenate(seqs), np.array([len(s) for s in seqs]))
    for ext in (".idx", ".bin"):
        assert open(f"{tmp_path}/a{ext}", "rb").read() == open(f"{tmp_path}/b{ext}", "rb").read()


def golden(prefix, seqs, code=8, dtype="<u2"):
    """The byte layout written out by hand, field by field."""
    lengths = [len(s) for s in seqs]
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(seqs) + 1))
        f.write(struct.pack(f"<{len(seqs)}i", *lengths))
        f.write(struct.pack(f"<{len(seqs)}q", *pointers))
        f.write(struct.pack(f"<{len(seqs) + 1}q", *range(len(seqs) + 1)))
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=dtype).tobytes())


def test_reads_golden_fixture_and_writes_identical_bytes(tmp_path):
    seqs = [[1, 2, 3], [65000, 7], [], [42]]
    golden(tmp_path / "g", seqs)
    ds = IndexedDataset(tmp_path / "g")
    assert ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(len(ds))] == seqs
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    _write(tmp_path / "w", seqs, np.uint16)
    for ext in (".idx", ".bin"):
        assert open(f"{tmp_path}/g{ext}", "rb").read() == open(f"{tmp_path}/w{ext}", "rb").read()


def test_token_dtype_rule():
    assert token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32
    assert token_dtype(128896) == np.int32


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: open(f"{p}.idx", "r+b").write(b"XXXX"), "bad magic"),
    (lambda p: _patch(f"{p}.idx", 9, struct.pack("<Q", 2)), "unsupported version 2"),
    (lambda p: _patch(f"{p}.idx", 17, b"\x09"), "unknown dtype code 9"),
    (lambda p: _truncate(f"{p}.idx", 20), "truncated header"),
    (lambda p: _truncate(f"{p}.idx", 60), "truncated: 60 bytes"),
    (lambda p: _truncate(f"{p}.bin", 5), "truncated or mismatched pair"),
    (lambda p: os.remove(f"{p}.bin"), "no such file"),
])
def test_corrupt_files_get_named_errors(tmp_path, corrupt, message):
    prefix = tmp_path / "c"
    _write(prefix, [[1, 2, 3], [4, 5]], np.uint16)
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError, match=message) as e:
        IndexedDataset(prefix)
    assert str(tmp_path) in str(e.value)  # the message names the file


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def test_exception_inside_writer_leaves_no_final_files(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add(np.arange(10))
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_values_out_of_range_are_refused(tmp_path):
    with IndexedDatasetWriter(tmp_path / "r", np.uint16) as w:
        with pytest.raises(ValueError, match="outside uint16's range"):
            w.add(np.array([70000]))
