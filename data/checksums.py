"""CRC-32 of every 1 MiB block of a dataset's ``.bin``, recorded when it is written and checked
when training reads it.

A ``.bin`` can rot (a bad disk, a broken copy) with its size and modification time kept, and a
damaged token is still a token: nothing else would notice. ``IndexedDatasetWriter`` computes the
CRC of each ``BLOCK_BYTES`` block as it streams the data out (zlib's CRC-32, ~1.7 GB/s on one
core, beside a tokenizer's few MB/s) and records them in the sidecar
(``"checksums": {"block_bytes", "crc32": [...]}``, ~12 bytes of JSON per MiB of data). The
training loader attaches them to its datasets (``IndexedDataset.verify_with``): the first read
that touches a block checks the whole block, and a checked block is not checked again by that
reader. So every byte that trains is checked once per process, for about one extra read of the
data it uses (1 MiB per block first touched: ~0.6 ms of CRC), whatever the number of epochs.

A copy made with plain ``cp`` keeps its checksums with the rest of what its sidecar records
(``dataset_stats.recorded_facts``); a dataset written by Megatron-LM records none and is read
unchecked, as before.
"""
from __future__ import annotations

import zlib

import numpy as np

BLOCK_BYTES = 1 << 20


class BlockCRC:
    """Streaming CRC-32 per ``BLOCK_BYTES`` block of bytes written back to back."""

    def __init__(self):
        self.crcs: list[int] = []
        self._crc, self._fill = 0, 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), BLOCK_BYTES - self._fill)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._fill += take
            view = view[take:]
            if self._fill == BLOCK_BYTES:
                self.crcs.append(self._crc)
                self._crc, self._fill = 0, 0

    def record(self) -> dict:
        """What the sidecar records (the last, partial block included)."""
        return {"block_bytes": BLOCK_BYTES, "crc32": self.crcs + ([self._crc] if self._fill else [])}


class VerifiedBlocks:
    """Checks reads of one memory-mapped ``.bin`` against its recorded block checksums."""

    def __init__(self, path: str, data: np.ndarray, pointers: np.ndarray, record: dict):
        self.path, self.pointers = path, pointers
        self.data = data.reshape(-1).view(np.uint8) if data.size else np.empty(0, np.uint8)
        self.block = int(record["block_bytes"])
        self.crcs = np.asarray(record["crc32"], dtype=np.int64)
        if len(self.crcs) != -(-self.data.size // self.block):
            from data.indexed_dataset import DatasetError

            raise DatasetError(f"{path}: {self.data.size:,} bytes, but its sidecar records checksums "
                               f"of {len(self.crcs)} blocks of {self.block:,} bytes (a mismatched "
                               "sidecar); run tools/preprocess_data.py again")
        self.checked = np.zeros(len(self.crcs), dtype=bool)

    def check(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` lie in blocks whose CRC matches the record."""
        if end <= start:
            return
        first, last = start // self.block, (end - 1) // self.block
        if self.checked[first:last + 1].all():
            return
        for k in range(first, last + 1):
            if not self.checked[k]:
                self._check_block(k)

    def _check_block(self, k: int) -> None:
        from data.indexed_dataset import DatasetError

        a, b = k * self.block, min((k + 1) * self.block, self.data.size)
        got = zlib.crc32(self.data[a:b])
        if got != int(self.crcs[k]):
            docs = np.searchsorted(self.pointers, [a, b - 1], side="right") - 1
            raise DatasetError(
                f"{self.path}: bytes {a:,}..{b - 1:,} (documents {max(int(docs[0]), 0)}.."
                f"{int(docs[1])}) are damaged: their CRC-32 is {got:08x}, {int(self.crcs[k]):08x} was "
                "recorded when the file was written (it changed after preprocessing: a disk or copy "
                "error). Restore the file from a good copy, or run tools/preprocess_data.py again")
        self.checked[k] = True
