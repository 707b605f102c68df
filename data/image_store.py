"""The images of an image + text dataset, and a micro-batch's :class:`core.packed_seq.ImageInputs`.

An image run of ``tools/preprocess_data.py`` publishes, beside ``PREFIX_text_document`` and its
loss mask (all four as one unit, ``data/units.py``):

* ``PREFIX_images_document`` (uint8): one sequence per image, its encoded file bytes as read
  (JPEG, PNG, ...: never re-encoded), images in document order;
* ``PREFIX_image_index_document`` (int64): one sequence per document, aligned with the text,
  five numbers per image: the start of its placeholder run in the document's tokens, the run's
  length, the image's width and height (after EXIF orientation), and the CRC-32 of its bytes.
  Document ``d``'s images are images ``first[d] .. first[d] + n[d] - 1``, ``first`` being the
  running count (a text-only document has none);
* in every sidecar (``PREFIX_*.meta.json``) ``"images": {"processor": settings, "token_ids",
  "image_token_id", "checksum": "crc32"}``: the image processor's settings and special tokens,
  which training rebuilds (or checks) the processor from.

The images file can rot (a bad disk, a broken copy) with its size and modification time kept,
and a JPEG decodes damaged bytes into other pixels without an error: the loader checks each
image's CRC-32 against the index before decoding it, on bytes it reads anyway (~0.1 ms for a
0.2 MB JPEG, against ~10 ms to decode it), and a mismatch is a
:class:`~data.indexed_dataset.DatasetError` naming the file, the image and its document. A
dataset of an earlier version (four numbers per image, no checksums) is refused with a message
to preprocess it again.

Why encoded bytes, not preprocessed pixels (docs/vlm.md has the numbers): a 1024 x 768 JPEG is
~0.1-0.2 MB, its float32 global view and four crops 18.6 MB (~100x more); decoding and
preprocessing it again in the loader costs tens of milliseconds on one core, and the dataset
stays valid if crop settings are changed. The decoding runs in the data-loader workers
(``--num-workers``, ``data/prefetch.py``), ahead of the step; with ``--num-workers 0`` on the
training thread, on the step's critical path. Only the first pipeline stage decodes; under
context parallelism every CP rank does (each encodes its pack's images).

The loader decodes an image and runs the processor only for the packs that hold it, and checks
each run against the tokens: the tokens at a run must be the processor's placeholder run for the
image's size (a dataset made with other settings fails naming the image), and every image token
of the micro-batch must lie in a run. A pack plan that cuts through a run (a document longer than
``--seq-length``, split across packs or truncated) is refused when the plan is built
(:func:`check_cut_runs`): the image's features would be split or lost.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from core.packed_seq import ImageInputs
from data.dataset_stats import recorded_facts
from data.chat import RowError
from data.images import INDEX_COLUMNS, ImageProcessor, checksum, decode_image
from data.indexed_dataset import DatasetError, IndexedDataset
from data.units import check_member

INDEX_WIDTH = INDEX_COLUMNS  # start, length, width, height, CRC-32


def image_prefixes(text_prefix: str) -> tuple[str, str] | None:
    """(images, image index) dataset prefixes beside ``PREFIX_text_document``."""
    if not text_prefix.endswith("_text_document"):
        return None
    base = text_prefix[:-len("_text_document")]
    return f"{base}_images_document", f"{base}_image_index_document"


def has_images(text_prefix: str) -> bool:
    """Whether an image index lies beside ``text_prefix`` (an image run's dataset)."""
    names = image_prefixes(text_prefix)
    return names is not None and os.path.exists(names[1] + ".idx")


class ImageStore:
    """The images of one text dataset and the processor that turns them into pixels."""

    def __init__(self, text_prefix: str, images: IndexedDataset, index: IndexedDataset,
                 processor: ImageProcessor, doc_lengths: np.ndarray):
        if len(index) != len(doc_lengths):
            raise DatasetError(f"{index.prefix}: {len(index)} documents but {text_prefix} has "
                               f"{len(doc_lengths)}")
        if (index.lengths % INDEX_WIDTH).any():
            bad = int(np.flatnonzero(index.lengths % INDEX_WIDTH)[0])
            raise DatasetError(f"{index.prefix}: document {bad} has {int(index.lengths[bad])} entries, "
                               f"not a multiple of {INDEX_WIDTH} (corrupt image index)")
        counts = index.lengths.astype(np.int64) // INDEX_WIDTH
        self.first = np.concatenate([[0], np.cumsum(counts)])
        if self.first[-1] != len(images):
            raise DatasetError(f"{index.prefix} names {int(self.first[-1])} images but {images.prefix} "
                               f"holds {len(images)}")
        self.text_prefix, self.images, self.index, self.processor = text_prefix, images, index, processor
        # every image's row, in image order (the documents' sequences lie back to back: the
        # index was validated at open); a view of the memory map, nothing is read here
        self.table = np.asarray(index._bin).reshape(-1, INDEX_WIDTH)
        self.doc_lengths = doc_lengths
        self.image_token_id = int(processor.image_token_id)

    def runs(self, doc: int) -> np.ndarray:
        """int64 ``[k, 5]``: (start, length, width, height, CRC-32) of document ``doc``'s images."""
        return np.asarray(self.index.get(doc)).reshape(-1, INDEX_WIDTH)

    def images_in(self, doc: int, start: int, n: int) -> list[tuple[int, int, int, int, int]]:
        """(image id, run start in the segment, run length, width, height) of every image of
        segment ``[start, start + n)`` of ``doc``; ``DatasetError`` when the segment cuts a run."""
        out = []
        for k, (s, length, w, h, _) in enumerate(self.runs(doc).tolist()):
            if s >= start and s + length <= start + n:
                out.append((int(self.first[doc]) + k, s - start, length, w, h))
            elif s < start + n and s + length > start:
                cut = start if s < start else start + n
                raise DatasetError(_cut_message(self.text_prefix, doc, k, s, length, cut,
                                                int(self.doc_lengths[doc]), None))
        return out

    def pixels(self, image: int, width: int, height: int):
        """(global view, crops) of image ``image``, checked against its recorded size."""
        name = f"{self.images.prefix} image {image}"
        data = bytes(self.images.get(image))
        want, got = int(self.table[image, 4]), checksum(data)
        if got != want:
            doc = int(np.searchsorted(self.first, image, side="right")) - 1
            raise DatasetError(
                f"{self.images.prefix}.bin: image {image} (document {doc}) is damaged: the CRC-32 "
                f"of its {len(data):,} bytes is {got:08x}, {self.index.prefix} recorded {want:08x} "
                "when it was written (the file changed after preprocessing: a disk or copy error). "
                "Restore the file from a good copy, or run tools/preprocess_data.py again")
        try:
            img = decode_image(data, max_pixels=width * height, name=name)
        except RowError as e:  # its checksum holds: the bytes are the ones preprocessing decoded
            raise DatasetError(f"{e.detail} (it decoded when the dataset was made: another PIL "
                               "version? run tools/preprocess_data.py again)") from None
        if img.size != (width, height):
            raise DatasetError(f"{name}: decodes to {img.size[0]} x {img.size[1]}, but its index "
                             f"records {width} x {height}")
        return self.processor.pixels(img)


def _cut_message(prefix: str, doc: int, k: int, s: int, length: int, cut: int, doc_length: int,
                 long_docs: str | None) -> str:
    how = {"truncate": "--long-docs truncate cuts it", "split": "--long-docs split splits it"}.get(
        long_docs, "the pack plan cuts it")
    return (f"{prefix}: document {doc} ({doc_length} tokens, longer than --seq-length) would lose "
            f"part of its image {k}: {how} at token {cut}, inside the image's placeholder run "
            f"(tokens {s}..{s + length - 1}), so the image's features would be split or lost. Use "
            f"--long-docs drop to leave such documents out, or a --seq-length of at least {doc_length}")


def check_cut_runs(store: ImageStore, segments: np.ndarray, long_docs: str | None = None) -> None:
    """Refuse a pack plan (``segments``: ``(doc, start, n)`` rows) in which a segment starts or
    ends strictly inside an image's placeholder run (a split document's next pack, a truncated
    document's end), naming the first such document and image. Segments of whole documents
    (most of them) cannot cut a run and are left out; the rest take one vectorised pass,
    O((images + segments) log segments): 0.2-1 s for a million images and a million partial
    segments on the shared 2-core machine, 0.01 s when every document is whole."""
    segments = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    lengths = np.asarray(store.doc_lengths, dtype=np.int64)
    # a whole document's segment ends at 0 and at its length, never strictly inside a run
    segments = segments[(segments[:, 1] > 0) | (segments[:, 2] < lengths[segments[:, 0]])]
    table = store.table
    if not len(table) or not len(segments):
        return
    doc_of = np.repeat(np.arange(len(store.first) - 1), np.diff(store.first))
    key = doc_of << 32  # documents and their lengths are < 2^31: (doc, offset) as one int64
    run_lo, run_hi = key + table[:, 0], key + table[:, 0] + table[:, 1]
    seg_key = segments[:, 0] << 32
    ends = np.sort(np.concatenate([seg_key + segments[:, 1], seg_key + segments[:, 1] + segments[:, 2]]))
    first_after = np.searchsorted(ends, run_lo, side="right")
    bad = np.flatnonzero(np.searchsorted(ends, run_hi, side="left") > first_after)
    if len(bad):
        i = int(bad[0])
        doc = int(doc_of[i])
        cut = int(ends[first_after[i]] - (doc << 32))
        raise DatasetError(_cut_message(store.text_prefix, doc, i - int(store.first[doc]),
                                        int(table[i, 0]), int(table[i, 1]), cut,
                                        int(store.doc_lengths[doc]), long_docs))


def check_runs(store: ImageStore, tokens: np.ndarray, where: int, image: int, length: int,
               width: int, height: int) -> None:
    """The tokens at a run are the processor's placeholder run for the image's size."""
    want = np.asarray(store.processor.placeholder_ids(width, height), dtype=np.int64)
    got = tokens[where:where + length]
    if len(want) != length or not np.array_equal(got, want):
        raise DatasetError(f"{store.images.prefix} image {image} ({width} x {height}): the tokens at "
                           "its run are not the image processor's placeholder run for its size (the "
                           "dataset was made with other processor settings: preprocess it again)")


def batch_images(placed: list, tokens: np.ndarray) -> ImageInputs | None:
    """The :class:`ImageInputs` of a micro-batch. ``placed``: per segment ``(store or None, doc,
    start, n, position in T)``, in token order; ``tokens``: the micro-batch's ``[T]`` tokens."""
    globals_, crops, counts, token_id, in_runs = [], [], [], None, 0
    for store, doc, start, n, pos in placed:
        if store is None:
            continue
        token_id = store.image_token_id
        for image, s, length, w, h in store.images_in(doc, start, n):
            check_runs(store, tokens, pos + s, image, length, w, h)
            g, c = store.pixels(image, w, h)
            globals_.append(torch.as_tensor(g, dtype=torch.float32))
            crops.append(torch.as_tensor(c, dtype=torch.float32))
            counts.append(int(c.shape[0]))
            in_runs += int(np.count_nonzero(tokens[pos + s:pos + s + length] == token_id))
    if token_id is None:
        return None
    positions = np.flatnonzero(tokens == token_id)
    if len(positions) != in_runs:
        raise DatasetError(f"the micro-batch holds {len(positions)} image tokens ({token_id}) but its "
                           f"images' runs hold {in_runs}: a document holds the image token outside "
                           "an image's run")
    if not globals_:
        return None
    local = torch.cat(crops) if sum(counts) else None
    return ImageInputs(torch.stack(globals_), local, tuple(counts), torch.from_numpy(positions))


def pack_image_counts(index: IndexedDataset, segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per segment ``(doc, start, n)``: the images whose runs it holds whole, and their tokens
    (runs cut by the segment are counted nowhere: the loader refuses them)."""
    images, tokens = np.zeros(len(segments), np.int64), np.zeros(len(segments), np.int64)
    for i, (doc, start, n) in enumerate(np.asarray(segments).tolist()):
        if index.lengths[doc]:
            runs = np.asarray(index.get(doc)).reshape(-1, INDEX_WIDTH)
            whole = (runs[:, 0] >= start) & (runs[:, 0] + runs[:, 1] <= start + n)
            images[i], tokens[i] = int(whole.sum()), int(runs[whole, 1].sum())
    return images, tokens


def concat_images(parts: list, offsets: list[int]) -> ImageInputs | None:
    """The images of several batches laid end to end (``offsets``: where each starts in T)."""
    have = [(p, o) for p, o in zip(parts, offsets) if p is not None]
    if any(p.feature_index is not None for p, _ in have):
        raise ValueError("concat_images: whole micro-batches only (a CP shard's images are cut last)")
    if not have:
        return None
    local = [p.pixel_values_local for p, _ in have if p.pixel_values_local is not None]
    return ImageInputs(torch.cat([p.pixel_values for p, _ in have]),
                       torch.cat(local) if local else None,
                       tuple(n for p, _ in have for n in p.num_local_patches),
                       torch.cat([p.feature_positions + o for p, o in have]))


def open_images(text_prefix: str, doc_lengths: np.ndarray, image_processor=None,
                cache_path: str | None = None) -> ImageStore | None:
    """The images beside ``text_prefix`` (None for a text-only dataset).

    ``image_processor``: a processor, or a callable ``(settings, token_ids) -> processor`` that
    rebuilds one from what is recorded beside the dataset (``models.registry.
    image_processor_from_settings``). A dataset with images and no processor given,
    or a processor whose settings differ from the recorded ones, is refused (its placeholder
    runs would not match the tokens)."""
    names = image_prefixes(text_prefix)
    facts = recorded_facts(text_prefix, cache_path)
    recorded = facts.get("images")
    if names is None or not (recorded or any(os.path.exists(p + ".idx") for p in names)):
        return None
    for key, prefix in zip(("images", "image_index"), names):
        check_member(text_prefix, key, prefix, cache_path)
    if not isinstance(recorded, dict) or "processor" not in recorded:
        raise DatasetError(f"{text_prefix}: images beside it but its sidecar ({text_prefix}.meta.json) "
                           "records no image processor settings; run tools/preprocess_data.py again")
    if recorded.get("checksum") != "crc32":
        raise DatasetError(f"{text_prefix}: made by an earlier version of tools/preprocess_data.py, "
                           "whose image index holds no checksums of the images (a damaged images "
                           "file could not be told from a good one); run tools/preprocess_data.py "
                           "again to train on it")
    if image_processor is None:
        raise ValueError(f"{text_prefix} holds images: reading it needs the image processor it was "
                         "made with (image_processor=: a processor, or a factory that rebuilds it "
                         "from the settings recorded beside the dataset)")
    proc = image_processor if isinstance(image_processor, ImageProcessor) \
        else image_processor(recorded["processor"], recorded.get("token_ids", {}))
    if _jsonable(proc.settings) != recorded["processor"] or \
            int(proc.image_token_id) != recorded["image_token_id"]:
        raise ValueError(f"{text_prefix}: made with image processor settings "
                         f"{recorded['processor']} (image token {recorded['image_token_id']}), but "
                         f"the processor given has {proc.settings} (image token "
                         f"{proc.image_token_id}); use the processor the dataset was made with, or "
                         "preprocess it again")
    images, index = (IndexedDataset(p) for p in names)
    # the index is small (40 bytes per image) and read whole by check_cut_runs: checked whole now
    index.verify_with(recorded_facts(index.prefix, cache_path).get("checksums"), now=True)
    return ImageStore(text_prefix, images, index, proc, doc_lengths)


def _jsonable(settings: dict) -> dict:
    """``settings`` as JSON gives them back (tuples become lists), to compare with the record."""
    import json

    return json.loads(json.dumps(settings))
