"""Which files tools/preprocess_data.py reads: never its own outputs (a second run over
``dir/*.jsonl`` read the first run's rejects back as documents), each file once, never an input
that the run would overwrite; a UTF-8 byte-order mark is not part of the first row."""
from __future__ import annotations

import codecs
import gzip
import json
import os

import pytest

from data.indexed_dataset import IndexedDataset
from tools.preprocess_data import main

ROWS = [json.dumps({"text": f"row number {i}"}) for i in range(4)]


def _write(path, rows, bom=False):
    data = ("\n".join(rows) + "\n").encode()
    path.write_bytes((codecs.BOM_UTF8 if bom else b"") + data)


def _docs(prefix) -> list[bytes]:
    ds = IndexedDataset(f"{prefix}_text_document")
    return [bytes(ds[i].astype("uint8")) for i in range(len(ds))]


def test_a_second_run_over_a_glob_never_reads_its_own_rejects_or_temporaries(tmp_path, capsys):
    """The rejects file (valid JSON with a "text" key) and a leftover temporary of another prefix
    match ``*.jsonl*``; both are left out, and the run says so."""
    _write(tmp_path / "a.jsonl", ROWS + ['{"text": ""}', "not json"])
    args = ["--input", str(tmp_path / "*.jsonl*"), "--output-prefix", str(tmp_path / "out"),
            "--max-rejected-fraction", "1"]
    assert main(args) == 0
    first = _docs(tmp_path / "out")
    assert len(first) == 4 and (tmp_path / "out_rejects.jsonl").exists()
    (tmp_path / "old_rejects.jsonl.tmp-123").write_text('{"text": "half-written reject"}\n')
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert _docs(tmp_path / "out") == first
    assert "left out 2 file(s) that preprocessing writes" in err
    assert str(tmp_path / "out_rejects.jsonl") in err and "old_rejects.jsonl.tmp-123" in err


def test_an_output_named_as_input_or_an_input_the_run_would_overwrite_is_refused(tmp_path, capsys):
    _write(tmp_path / "a.jsonl", ROWS)
    (tmp_path / "b_rejects.jsonl").write_text(json.dumps({"text": "a rejected row"}) + "\n")
    cases = [(["--input", str(tmp_path / "b_rejects.jsonl"), "--output-prefix", str(tmp_path / "b")],
              "is a file that preprocessing writes"),
             (["--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "a.jsonl")],
              "is also an --input file")]
    os.symlink(tmp_path / "b_rejects.jsonl", tmp_path / "link.jsonl")  # another name for it
    cases.append((["--input", str(tmp_path / "link.jsonl"), "--output-prefix", str(tmp_path / "b")],
                  "is a file that preprocessing writes"))
    for args, message in cases:
        assert main(args) == 1, args
        assert message in capsys.readouterr().err
    assert (tmp_path / "b_rejects.jsonl").read_text() == json.dumps({"text": "a rejected row"}) + "\n"
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b_rejects.jsonl", "link.jsonl"]


def test_the_same_file_given_twice_is_read_once_and_said(tmp_path, capsys, monkeypatch):
    _write(tmp_path / "a.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    assert main(["--input", "a.jsonl", "./a.jsonl", "*.jsonl", str(tmp_path / "a.jsonl"),
                 "--output-prefix", "out"]) == 0
    assert len(_docs(tmp_path / "out")) == 4
    assert "a.jsonl was given 4 times" in capsys.readouterr().err


@pytest.mark.parametrize("gz", [False, True])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_row(tmp_path, gz):
    _write(tmp_path / "bom.jsonl", ROWS, bom=True)
    path = tmp_path / "bom.jsonl"
    if gz:
        path = tmp_path / "bom.jsonl.gz"
        path.write_bytes(gzip.compress((tmp_path / "bom.jsonl").read_bytes()))
    assert main(["--input", str(path), "--output-prefix", str(tmp_path / "out"),
                 "--max-rejected-fraction", "0"]) == 0
    assert _docs(tmp_path / "out")[0] == b"row number 0"
    assert (tmp_path / "out_rejects.jsonl").read_text() == ""
