"""Parquet, Arrow and datasets.save_to_disk inputs of tools/preprocess_data.py: the same rows give
the same .bin/.idx bytes as JSONL; every row is accepted or rejected with its file and row index;
a missing column stops the run before any work; a damaged file names itself; units of work stay
near --chunk-mb (bounded memory)."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import preprocess
from data.columnar import iter_units
from data.indexed_dataset import IndexedDataset
from data.tokenizers import ByteTokenizer
from tools.preprocess_data import PreprocessConfig, main

TEXT_ROWS = [{"text": f"document {i}: " + "wörds " * (i % 37), "id": i} for i in range(500)]
TEXT_ROWS[5] = {"text": None, "id": 5}       # JSONL: wrong_type (null); columns: missing_key
TEXT_ROWS[17] = {"text": "  \n ", "id": 17}  # empty_text in both
CALL = [{"type": "function", "function": {"name": "lookup", "arguments": '{"q": "moe"}'}}]


def chat_rows(n: int = 120) -> list[dict]:
    rows = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"question {i}"}]
        if i % 3 == 0:
            msgs.append({"role": "assistant", "content": None, "tool_calls": CALL})
            msgs.append({"role": "tool", "content": f"result {i}"})
        answer = {"role": "assistant", "content": f"answer {i} ✓"}
        if i % 4 == 0:
            answer["reasoning_content"] = f"thinking about {i}"
        rows.append({"messages": msgs + [answer]})
    rows[7] = {"messages": [{"role": "user", "content": "no answer"}]}  # no_assistant_turn
    return rows


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({k: v for k, v in r.items()}, ensure_ascii=False) + "\n")


def write_arrow(path, table: pa.Table, stream: bool, batch_rows: int):
    with pa.OSFile(str(path), "wb") as f:
        writer = (pa.ipc.new_stream if stream else pa.ipc.new_file)(f, table.schema)
        for b in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(b)
        writer.close()


def write_saved_dataset(folder, table: pa.Table, shards: int = 2):
    """What datasets' save_to_disk writes: Arrow stream shards, state.json, dataset_info.json."""
    os.makedirs(folder)
    names, step = [], -(-table.num_rows // shards)
    for k in range(shards):
        names.append(f"data-{k:05d}-of-{shards:05d}.arrow")
        write_arrow(os.path.join(folder, names[-1]), table.slice(k * step, step), True, 100)
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": n} for n in names], "_split": None}, f)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"features": {}}, f)


def write_as(fmt: str, path_stem, rows: list[dict]) -> str:
    table = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        path = f"{path_stem}.parquet"
        pq.write_table(table, path, row_group_size=97)
    elif fmt in ("arrow_file", "arrow_stream"):
        path = f"{path_stem}.arrow"
        write_arrow(path, table, fmt == "arrow_stream", batch_rows=150)
    else:
        path = f"{path_stem}_saved"
        write_saved_dataset(path, table)
    return path


def _run(tmp_path, name, inputs, **kw):
    kw.setdefault("max_rejected_fraction", 1.0)
    out = tmp_path / name
    out.mkdir()
    cfg = PreprocessConfig(input=[str(p) for p in inputs], output_prefix=str(out / "o"), **kw)
    stats = preprocess.run(cfg, progress=False)
    keys = ["text", "loss_mask"] if kw.get("chat") else ["text"]
    files = {k + e: (out / f"o_{k}_document{e}").read_bytes() for k in keys for e in (".bin", ".idx")}
    rejects = [json.loads(l) for l in (out / "o_rejects.jsonl").read_text().splitlines()]
    return stats, files, rejects


@pytest.mark.parametrize("fmt, workers, chunk_mb", [("parquet", 2, 0.002), ("parquet", 1, 4.0),
                                                     ("arrow_file", 1, 0.002), ("arrow_stream", 1, 0.002),
                                                     ("saved", 1, 0.002)])
def test_the_same_rows_give_the_same_bytes_as_jsonl(tmp_path, fmt, workers, chunk_mb):
    """Text and chat (tool calls, reasoning), in workers or in-process, in tiny units or one:
    .bin/.idx equal the JSONL run's byte for byte; the rejected rows are the same, by index."""
    for mode, rows, kw in (("text", TEXT_ROWS, {}), ("chat", chat_rows(), {"chat": "messages"})):
        write_jsonl(tmp_path / f"{mode}.jsonl", rows)
        stats, want, rej = _run(tmp_path, f"{mode}_jsonl", [tmp_path / f"{mode}.jsonl"], **kw)
        src = write_as(fmt, tmp_path / mode, rows)
        got_stats, got, got_rej = _run(tmp_path, mode, [src], workers=workers, chunk_mb=chunk_mb, **kw)
        assert got == want, mode
        assert (got_stats.rows_read, got_stats.accepted) == (stats.rows_read, stats.accepted)
        assert [r["row"] for r in got_rej] == [r["line"] - 1 for r in rej]
        assert stats.accepted == len(rows) - (2 if mode == "text" else 1)


def test_rejects_name_the_file_the_row_and_the_reason(tmp_path):
    """A column of the wrong type rejects its rows (wrong_type), a null is a missing value, an
    empty text is empty_text, invalid UTF-8 is invalid_utf8; rows read = accepted + rejected."""
    pq.write_table(pa.table({"text": ["ok one", None, " ", "ok two"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    bad_utf8 = pa.Array.from_buffers(pa.string(), 2, [None, pa.py_buffer(
        b"\x00\x00\x00\x00\x02\x00\x00\x00\x04\x00\x00\x00"), pa.py_buffer(b"ok\xff\xfe")])
    pq.write_table(pa.table({"text": bad_utf8}), tmp_path / "u.parquet")
    stats, _, rej = _run(tmp_path, "out", [tmp_path / n for n in ("a.parquet", "ints.parquet", "u.parquet")])
    assert (stats.rows_read, stats.accepted, stats.num_rejected) == (8, 3, 5)
    got = [(os.path.basename(r["file"]), r["row"], r["reason"]) for r in rej]
    assert got == [("a.parquet", 1, "missing_key"), ("a.parquet", 2, "empty_text"),
                   ("ints.parquet", 0, "wrong_type"), ("ints.parquet", 1, "wrong_type"),
                   ("u.parquet", 1, "invalid_utf8")]
    assert rej[2]["detail"] == "'text' must be a string, got int" and rej[2]["text"] == '{"text": 1}'
    assert "line" not in rej[0] and rej[0]["text"] == '{"text": null}'


def test_a_missing_column_stops_the_run_before_any_work(tmp_path, capsys):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "good.parquet")
    pq.write_table(pa.table({"body": ["a"], "id": [1]}), tmp_path / "other.parquet")
    args = ["--input", str(tmp_path / "good.parquet"), str(tmp_path / "other.parquet"),
            "--output-prefix", str(tmp_path / "out")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'other.parquet'}: no column 'text' (--json-keys text); its columns are body, id" in err
    assert main(args[:3] + ["--output-prefix", str(tmp_path / "out"), "--chat"]) == 1
    assert "no column 'messages' (--chat messages)" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["good.parquet", "other.parquet"]  # nothing written


def test_damaged_files_stop_the_run_naming_the_file(tmp_path, capsys):
    """A file that is not Parquet fails before any work; a damaged row group stops the run after
    the rows before it, naming the file; a truncated Arrow stream too. Nothing is published."""
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet")
    assert main(["--input", str(tmp_path / "junk.parquet"), "--output-prefix", str(tmp_path / "o")]) == 1
    assert "junk.parquet: cannot read it as Parquet" in capsys.readouterr().err
    rows = [{"text": f"row number {i} " * 5} for i in range(3000)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet", row_group_size=500,
                   compression="none")
    meta = pq.ParquetFile(tmp_path / "c.parquet").metadata
    data = bytearray((tmp_path / "c.parquet").read_bytes())
    off = meta.row_group(3).column(0).data_page_offset
    data[off:off + 40] = b"\xff" * 40
    (tmp_path / "c.parquet").write_bytes(bytes(data))
    write_arrow(tmp_path / "s.arrow", pa.Table.from_pylist(rows), True, 500)
    blob = (tmp_path / "s.arrow").read_bytes()
    (tmp_path / "s.arrow").write_bytes(blob[: len(blob) * 2 // 3])
    for name, read in (("c.parquet", "1,500"), ("s.arrow", "2,000")):
        args = ["--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "o"), "--chunk-mb", "0.01"]
        assert main(args) == 1
        err = capsys.readouterr().err
        assert f"{tmp_path / name}: cannot read" in err and f"after {read} complete rows" in err, err
    assert sorted(os.listdir(tmp_path)) == ["c.parquet", "junk.parquet", "s.arrow"]


def test_save_to_disk_folders_globs_and_files_given_twice(tmp_path, capsys):
    """A save_to_disk folder reads its shards in state.json's order; given with one of its own
    files too, that file is read once; a DatasetDict and a plain folder are refused by name."""
    rows = [{"text": f"saved row {i}"} for i in range(250)]
    write_saved_dataset(tmp_path / "ds", pa.Table.from_pylist(rows), shards=3)
    shard = tmp_path / "ds" / "data-00001-of-00003.arrow"
    assert main(["--input", str(tmp_path / "ds"), str(shard), str(tmp_path / "d*"),
                 "--output-prefix", str(tmp_path / "out")]) == 0
    assert "data-00001-of-00003.arrow was given 3 times" in capsys.readouterr().err
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [ByteTokenizer().decode(ds[i]) for i in range(len(ds))] == [r["text"] for r in rows]
    os.makedirs(tmp_path / "dd" / "train")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    assert main(["--input", str(tmp_path / "dd"), "--output-prefix", str(tmp_path / "x")]) == 1
    assert f"DatasetDict with splits train, test; give one split's folder (--input {tmp_path / 'dd' / 'train'})" \
        in capsys.readouterr().err
    assert main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "x")]) == 1
    assert "a folder, but not a datasets.save_to_disk folder" in capsys.readouterr().err


def test_a_saved_folder_without_state_json_suggests_the_files_it_holds(tmp_path, capsys):
    """save_to_disk's Arrow shards without state.json: the error names '*.arrow', not a kind of
    file the folder does not hold; a folder with several kinds names each; one with none says so."""
    write_saved_dataset(tmp_path / "ds", pa.Table.from_pylist([{"text": "a"}, {"text": "b"}]))
    os.remove(tmp_path / "ds" / "state.json")
    assert main(["--input", str(tmp_path / "ds"), "--output-prefix", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert (f"--input {tmp_path / 'ds'}: a folder, but not a datasets.save_to_disk folder (no state.json "
            f"and dataset_info.json); give its files: --input '{tmp_path / 'ds' / '*.arrow'}'") in err
    assert main(["--input", str(tmp_path / "ds" / "*.arrow"), "--output-prefix", str(tmp_path / "x")]) == 0
    (tmp_path / "ds" / "more.jsonl.gz").write_bytes(b"")
    assert main(["--input", str(tmp_path / "ds"), "--output-prefix", str(tmp_path / "y")]) == 1
    assert (f"give its files: --input '{tmp_path / 'ds' / '*.arrow'}' '{tmp_path / 'ds' / '*.jsonl.gz'}'"
            in capsys.readouterr().err)
    (tmp_path / "empty").mkdir()
    assert main(["--input", str(tmp_path / "empty"), "--output-prefix", str(tmp_path / "z")]) == 1
    assert "it holds no .parquet, .arrow, .feather, .jsonl, .jsonl.gz, .json, .json.gz file" in capsys.readouterr().err


def test_units_of_work_stay_near_chunk_mb_and_cover_the_file(tmp_path):
    """Units hold about --chunk-mb of the columns read (bounded memory): Parquet by row groups,
    Arrow by record batches, a batch larger than a unit cut into row ranges; their bytes add up
    to the file's size (the progress bar) and their rows to the file's rows."""
    table = pa.table({"text": [f"row {i} " + "y" * 200 for i in range(4000)], "other": list(range(4000))})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=100)
    write_arrow(tmp_path / "t.arrow", table, stream=True, batch_rows=4000)  # one big batch
    for name in ("t.parquet", "t.arrow"):
        path = str(tmp_path / name)
        units = list(iter_units(path, 50_000, ["text"]))
        assert len(units) >= 5 and sum(u["n_bytes"] for u in units) == os.path.getsize(path)
        rows = [b - a if b is not None else 100 for u in units for _, a, b in u["parts"]]
        assert sum(rows) == 4000, name
        if name == "t.arrow":
            assert max(rows) <= 400  # the 4,000-row batch is cut into zero-copy slices


def test_encoding_in_small_batches_gives_the_same_ids_and_loses_only_failing_rows(monkeypatch):
    """A large unit (a Parquet row group) is encoded a batch of characters at a time."""
    from data import preprocess_worker as pw

    class Tok(ByteTokenizer):
        calls = []

        def encode_batch(self, texts):
            self.calls.append(len(texts))
            if any("boom" in t for t in texts):
                raise ValueError("boom")
            return super().encode_batch(texts)

        def encode(self, text):
            if "boom" in text:
                raise ValueError("boom")
            return super().encode(text)

    texts = [f"text {i}" * (i % 5 + 1) for i in range(40)]
    texts[13] = "boom"
    monkeypatch.setattr(pw, "ENCODE_BATCH_CHARS", 50)
    ids, failed = pw._encode_rows(Tok(), texts)
    assert max(Tok.calls) < 40 and len(Tok.calls) > 5  # many small batches
    assert list(failed) == [13] and failed[13][0] == "tokenizer_error"
    assert [x for j, x in enumerate(ids) if j != 13] == [ByteTokenizer().encode(t) for j, t in enumerate(texts) if j != 13]


def test_a_glob_over_parquet_and_earlier_outputs_reads_only_the_input(tmp_path, capsys):
    """`--input 'dir/*'` beside an earlier run's outputs: the rejects file, datasets and sidecars
    are left out (and said), the Parquet file is read; the outputs are published together."""
    pq.write_table(pa.table({"text": ["one", "two", None]}), tmp_path / "a.parquet")
    args = ["--input", str(tmp_path / "*"), "--output-prefix", str(tmp_path / "out"),
            "--max-rejected-fraction", "1"]
    assert main(args) == 0
    first = (tmp_path / "out_text_document.bin").read_bytes()
    capsys.readouterr()
    assert main(args) == 0
    assert "left out 4 file(s) that preprocessing writes" in capsys.readouterr().err
    assert (tmp_path / "out_text_document.bin").read_bytes() == first
    meta = json.loads((tmp_path / "out_text_document.meta.json").read_text())
    assert meta["unit"]["datasets"] == ["text"]
    assert [json.loads(l)["row"] for l in (tmp_path / "out_rejects.jsonl").read_text().splitlines()] == [2]


def test_a_dictionary_encoded_arrow_stream_is_read_in_order(tmp_path):
    """Batches of a stream with dictionary-encoded columns need the dictionaries before them:
    such a file's units are read from the stream's start, and give the same rows."""
    texts = [f"label {i % 7} of row {i}" for i in range(600)]
    table = pa.table({"text": pa.array(texts).dictionary_encode()})
    write_arrow(tmp_path / "d.arrow", table, stream=True, batch_rows=50)
    units = list(iter_units(str(tmp_path / "d.arrow"), 500, ["text"]))
    assert len(units) > 3 and all(p[0][2] is None for u in units for p in u["parts"])
    stats, _, _ = _run(tmp_path, "out", [tmp_path / "d.arrow"], chunk_mb=0.0005)
    ds = IndexedDataset(tmp_path / "out" / "o_text_document")
    assert stats.accepted == 600 and [ByteTokenizer().decode(ds[i]) for i in range(600)] == texts
