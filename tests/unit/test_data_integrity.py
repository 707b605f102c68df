"""A dataset is trusted by its bytes, not by sizes and modification times: a copy made with plain
``cp`` trains, one flipped byte of one image or of the tokens (size and modification time kept)
is refused naming the file and the image or documents, and an image dataset of the version
without checksums is refused with what to do. Training refuses a tokenizer or processor folder other than
the one the data was made with, and a missing images file is one line at start-up."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from data import checksums
from data.checks import check_made_with, check_training_data
from data.image_store import image_prefixes
from data.indexed_dataset import DatasetError, IndexedDataset
from data.loader import THDLoader, open_source
from data.tokenizers import build_tokenizer
from models.registry import image_processor_from_settings, load_image_processor
from tools.preprocess_data import main as preprocess_main
from tests.unit.test_vlm_data import PROC_DIR, good_rows, images_dir, preprocess, write_jsonl  # noqa: F401


def _all_batches(prefix: str):
    src = open_source(prefix, 256, "split", 0, image_processor=image_processor_from_settings)
    loader = THDLoader([(1.0, src)], seq_length=256, micro_batch_size=src.plan.num_packs, pad_id=0)
    return loader.micro_batch(0)


def _copy_without_times(src_dir, dst_dir):
    dst_dir.mkdir()
    for f in os.listdir(src_dir):
        shutil.copyfile(src_dir / f, dst_dir / f)  # contents only, as `cp` without -p
        os.utime(dst_dir / f, ns=(10**18, 10**18))  # surely not the sidecars' recorded times


def test_a_cp_copy_trains_and_a_flipped_byte_is_refused_naming_the_image(images_dir):
    prefix = preprocess([write_jsonl(images_dir / "rows.jsonl", good_rows())], images_dir / "a" / "o")
    want = _all_batches(prefix)
    _copy_without_times(images_dir / "a", images_dir / "b")
    copy = str(images_dir / "b" / "o_text_document")
    got = _all_batches(copy)  # the unit is read from the sidecars whose sizes match
    assert got.images is not None and np.array_equal(got.tokens, want.tokens)
    assert all(np.array_equal(x, y) for x, y in zip(got.images.pixel_values, want.images.pixel_values))

    # one byte inside image 1 (blue_box.jpg, document 1: JPEG decodes the damage silently)
    images = image_prefixes(copy)[0]
    start = int(IndexedDataset(images).pointers[1])
    st = os.stat(images + ".bin")
    with open(images + ".bin", "r+b") as f:
        f.seek(start + 300)
        b = f.read(1)
        f.seek(start + 300)
        f.write(bytes([b[0] ^ 0x10]))
    os.utime(images + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(images + ".bin").st_size == st.st_size
    with pytest.raises(DatasetError, match=r"o_images_document\.bin: image 1 \(document 1\) is damaged: "
                                           r"the CRC-32 .* Restore the file from a good copy"):
        _all_batches(copy)

    # a dataset of the version without checksums: refused, saying to preprocess again
    meta = images_dir / "a" / "o_text_document.meta.json"
    doc = json.loads(meta.read_text())
    del doc["images"]["checksum"]
    meta.write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match="earlier version .* run tools/preprocess_data.py again"):
        _all_batches(prefix)


def test_training_refuses_another_tokenizer_or_processor_folder(images_dir, tmp_path):
    prefix = preprocess([write_jsonl(images_dir / "rows.jsonl", good_rows()[:1])], images_dir / "o")
    tok = build_tokenizer("huggingface", PROC_DIR)
    moved = tmp_path / "moved"
    shutil.copytree(PROC_DIR, moved)  # the same files elsewhere: the same tokenizer and processor
    check_made_with(prefix, build_tokenizer("huggingface", str(moved)), "huggingface", str(moved),
                    load_image_processor)
    other = tmp_path / "other"  # another image size (and so other placeholder runs)
    shutil.copytree(PROC_DIR, other)
    cfg = json.loads((other / "preprocessor_config.json").read_text())
    cfg["size"] = {"height": 224, "width": 224}
    (other / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"--data-path {prefix} was made with --tokenizer-type huggingface "
                                         rf"--tokenizer-model {PROC_DIR}, but this run has .*{other}: another "
                                         "image processor \\(image_size 112 -> 224"):
        check_made_with(prefix, tok, "huggingface", str(other), load_image_processor)
    with pytest.raises(ValueError, match=r"this run has --tokenizer-type byte: another vocabulary "
                                         r"\(fingerprint \w+ -> \w+, 400 -> 260 tokens\)"):
        check_made_with(prefix, build_tokenizer("byte"), "byte", None, load_image_processor)


def test_start_up_refusals_are_one_line(images_dir, capsys):
    """Through pretrain_step37.main's validation (no process group, no model): another tokenizer,
    then an images file cut short, then one deleted."""
    import pretrain_step37

    prefix = preprocess([write_jsonl(images_dir / "rows.jsonl", good_rows()[:1])], images_dir / "o")
    images = image_prefixes(prefix)[0]
    common = ["--model-preset", "step37-tiny-vlm", "--vocab-size", "400", "--data-path", prefix,
              "--seq-length", "256", "--global-batch-size", "1", "--train-iters", "1"]
    argv = common + ["--tokenizer-type", "huggingface", "--tokenizer-model", PROC_DIR]
    capsys.readouterr()
    assert pretrain_step37.main(common + ["--tokenizer-type", "byte"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--tokenizer-model {PROC_DIR}, but this run has --tokenizer-type byte" in err
    with open(images + ".bin", "r+b") as f:  # damaged: cut short
        f.truncate(10)
    assert pretrain_step37.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and f"{images}.bin: 10 bytes" in err, err
    os.remove(images + ".bin")
    assert pretrain_step37.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{images}.bin: no such file" in err, err


def _flip(path: str, at: int) -> None:
    """One bit of byte ``at`` flipped; size and modification time kept."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_flipped_token_byte_is_refused_naming_the_file_and_documents(tmp_path, monkeypatch):
    """Blocks of 256 bytes here (1 MiB in use), so a tiny dataset has several."""
    monkeypatch.setattr(checksums, "BLOCK_BYTES", 256)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 6}) + "\n"
                                               for i in range(40)))
    (tmp_path / "a").mkdir()
    assert preprocess_main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                            str(tmp_path / "a" / "t"), "--workers", "1"]) == 0
    _copy_without_times(tmp_path / "a", tmp_path / "b")
    prefix = str(tmp_path / "b" / "t_text_document")
    check_training_data(prefix, 260)  # recomputes the copy's statistics, keeps its checksums

    def read_all():
        src = open_source(prefix, 128, "split", 0)
        THDLoader([(1.0, src)], seq_length=128, micro_batch_size=src.plan.num_packs, pad_id=0).micro_batch(0)

    read_all()
    _flip(prefix + ".bin", 600)  # in block 2: bytes 512..767
    with pytest.raises(DatasetError, match=r"t_text_document\.bin: bytes 512\.\.767 \(documents 3\.\.5\) are "
                                           r"damaged: .* Restore the file from a good copy"):
        read_all()
