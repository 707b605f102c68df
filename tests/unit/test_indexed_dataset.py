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


# Whole-index validation at open. Layout of the 5-sequence uint16 fixture below:
# sizes [3, 1, 4, 1, 5] at offset 34, byte offsets [0, 6, 8, 16, 18] at 34 + 4*5 = 54,
# document indices [0, 1, 2, 3, 4, 5] at 54 + 8*5 = 94.
SIZES = [3, 1, 4, 1, 5]


def _fixture(tmp_path):
    prefix = tmp_path / "v"
    _write(prefix, [np.arange(n) for n in SIZES], np.uint16)
    return prefix


@pytest.mark.parametrize("corrupt, message", [
    # a middle pointer off by one element: the old first/last check passed this
    (lambda p: _patch(f"{p}.idx", 54 + 8 * 2, struct.pack("<q", 10)),
     "sequence 2 starts at byte 10, but the sizes before it add up to 8 bytes"),
    # sizes permuted (same total, so the .bin size still matches): offsets no longer agree
    (lambda p: _patch(f"{p}.idx", 34, struct.pack("<5i", 4, 1, 3, 1, 5)),
     "sequence 1 starts at byte 6, but the sizes before it add up to 8 bytes"),
    (lambda p: _patch(f"{p}.idx", 34 + 4 * 3, struct.pack("<i", -1)), "sequence 3 has a negative size -1"),
    (lambda p: _patch(f"{p}.idx", 94 + 8 * 3, struct.pack("<q", 99)),
     r"document index entry 3 is 99, outside \[0, 5\]"),
    (lambda p: _patch(f"{p}.idx", 94 + 8 * 3, struct.pack("<q", 1)),
     r"document index entry 3 is 1, smaller than entry 2 \(2\)"),
    (lambda p: _patch(f"{p}.idx", 94 + 8 * 5, struct.pack("<q", 4)), "entry 5 is 4; document indices must run from 0 to 5"),
])
def test_corrupt_index_entries_fail_at_open_naming_file_and_entry(tmp_path, corrupt, message):
    prefix = _fixture(tmp_path)
    IndexedDataset(prefix)  # the fixture itself is valid
    corrupt(prefix)
    with pytest.raises(IndexedDatasetError, match=message) as e:
        IndexedDataset(prefix)
    assert f"{prefix}.idx" in str(e.value)


def test_validation_crosses_block_boundaries(tmp_path, monkeypatch):
    """Blocks of 2 entries: a bad pointer right after a block boundary is still found (the
    overlap entry), and a valid index passes in any block size."""
    import data.indexed_dataset as mod

    monkeypatch.setattr(mod, "CHECK_BLOCK", 2)
    prefix = _fixture(tmp_path)
    assert len(IndexedDataset(prefix)) == 5
    _patch(f"{prefix}.idx", 54 + 8 * 4, struct.pack("<q", 20))
    with pytest.raises(IndexedDatasetError, match="sequence 4 starts at byte 20"):
        IndexedDataset(prefix)


def test_writer_records_statistics_in_a_sidecar(tmp_path):
    """min / max token id and, for loss masks, the ones at a document's first token."""
    import json

    with IndexedDatasetWriter(tmp_path / "m", np.uint8) as w:
        w.add_many(np.array([1, 1, 0, 0, 1, 1], np.uint8), np.array([2, 0, 3, 1]))
    side = json.load(open(tmp_path / "m.meta.json"))
    # documents [1 1] [] [0 0 1] [1]: firsts are 1, 0, 1 -> two nonzero firsts
    assert side["stats"] == {"min": 0, "max": 1, "nonzero": 4, "nonzero_first": 2}
    from data.dataset_stats import compute_stats, load_stats

    ds = IndexedDataset(tmp_path / "m")
    assert compute_stats(ds, progress=False) == side["stats"]
    assert load_stats(ds) == side["stats"]
