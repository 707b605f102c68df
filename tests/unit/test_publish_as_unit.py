"""A chat dataset is published as one unit, and training reads it as one: a text whose loss
mask was not published, or a mask left by another run, is refused by name. A full disk while
writing is an error naming the file, not a traceback, and nothing is published."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from data.checks import check_training_data
from data.loader import open_source
from tools.preprocess_data import main

FULL = "/dev/full"  # every write fails with ENOSPC
CHATS = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                  {"role": "assistant", "content": f"answer number {i}"}]})
         for i in range(6)]
BAD_ROW = "not json"


def _prep(tmp_path, name, rows=CHATS, chat=True) -> str:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(rows) + "\n")
    args = ["--input", str(src), "--output-prefix", str(tmp_path / name), "--max-rejected-fraction", "1"]
    assert main(args + (["--chat"] if chat else [])) == 0
    return str(tmp_path / f"{name}_text_document")


def _published(tmp_path) -> list[str]:
    return sorted(f for f in os.listdir(tmp_path) if "_document" in f)


@pytest.mark.skipif(not os.path.exists(FULL), reason="needs /dev/full")
@pytest.mark.parametrize("target", ["out_text_document.bin", "out_loss_mask_document.idx",
                                    "out_loss_mask_document.meta.json", "out_rejects.jsonl"])
def test_a_full_disk_names_the_file_and_publishes_nothing(tmp_path, capsys, target):
    """The temporary file ``target`` is on a full disk (a link to /dev/full). The loss mask's
    index failing used to leave the text published without its mask."""
    (tmp_path / "c.jsonl").write_text("\n".join(CHATS + [BAD_ROW]) + "\n")
    tmp = tmp_path / f"{target}.tmp-{os.getpid()}"
    os.symlink(FULL, tmp)
    rc = main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "out"), "--chat",
               "--max-rejected-fraction", "1"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert f"cannot write {tmp}: No space left on device (the disk is full" in err
    assert "Traceback" not in err
    assert _published(tmp_path) == []
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_a_failed_rename_takes_back_what_was_published(tmp_path, capsys):
    """The mask's sidecar cannot take its final name (a directory is in the way): the text,
    already renamed, is removed again, so no half of the unit stays."""
    (tmp_path / "out_loss_mask_document.meta.json").mkdir()
    (tmp_path / "out_loss_mask_document.meta.json" / "x").write_text("")
    (tmp_path / "c.jsonl").write_text("\n".join(CHATS) + "\n")
    assert main(["--input", str(tmp_path / "c.jsonl"), "--output-prefix", str(tmp_path / "out"), "--chat"]) == 1
    assert "cannot write" in capsys.readouterr().err
    assert _published(tmp_path) == ["out_loss_mask_document.meta.json"]  # only the obstacle


def test_a_chat_text_without_its_loss_mask_is_refused(tmp_path):
    prefix = _prep(tmp_path, "sft")
    open_source(prefix, 64, "split", 0)  # the pair trains
    for ext in (".bin", ".idx", ".meta.json"):
        os.remove(tmp_path / f"sft_loss_mask_document{ext}")
    for read in (lambda: check_training_data(prefix, 260), lambda: open_source(prefix, 64, "split", 0)):
        with pytest.raises(ValueError, match="made by a --chat run, but its loss mask .*sft_loss_mask_document.idx is missing"):
            read()


def test_a_loss_mask_of_another_run_is_refused(tmp_path):
    """The same rows prepared twice give masks of the same lengths; the other run's mask, copied
    over this one's (modification times kept), used to be paired silently."""
    mine, other = _prep(tmp_path, "a"), _prep(tmp_path, "b")
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copy2(tmp_path / f"b_loss_mask_document{ext}", tmp_path / f"a_loss_mask_document{ext}")
    with pytest.raises(ValueError, match="a_loss_mask_document does not belong to .*a_text_document"):
        open_source(mine, 64, "split", 0)
    with pytest.raises(ValueError, match="does not belong"):
        check_training_data(mine, 260)
    open_source(other, 64, "split", 0)


def test_text_prepared_over_a_chat_prefix_removes_the_old_mask(tmp_path, capsys):
    prefix = _prep(tmp_path, "p")
    rows = [json.dumps({"text": f"plain text {i}"}) for i in range(6)]
    _prep(tmp_path, "p", rows, chat=False)
    assert "removed " + str(tmp_path / "p_loss_mask_document") in capsys.readouterr().out
    src = open_source(prefix, 64, "split", 0)
    assert src.loss_mask is None and len(src.text) == 6


def test_a_copy_that_loses_modification_times_keeps_its_unit(tmp_path):
    """The text copied without modification times (its sidecar is stale), the mask with them:
    recomputing the text's statistics keeps its unit, so the pair still trains."""
    _prep(tmp_path, "a")
    (tmp_path / "copy").mkdir()
    for f in os.listdir(tmp_path):
        if f.startswith("a_loss_mask_document"):
            shutil.copy2(tmp_path / f, tmp_path / "copy" / f)
        elif f.startswith("a_text_document"):
            shutil.copy(tmp_path / f, tmp_path / "copy" / f)
            os.utime(tmp_path / "copy" / f, ns=(1, 1))
    prefix = str(tmp_path / "copy" / "a_text_document")
    check_training_data(prefix, 260)  # recomputes and rewrites the text's sidecar
    meta = json.loads((tmp_path / "copy" / "a_text_document.meta.json").read_text())
    assert meta["identity"]["bin_mtime_ns"] == 1
    assert meta["unit"] == json.loads((tmp_path / "a_loss_mask_document.meta.json").read_text())["unit"]
    assert np.array_equal(open_source(prefix, 64, "split", 0).loss_mask.lengths,
                          open_source(str(tmp_path / "a_text_document"), 64, "split", 0).loss_mask.lengths)
