"""tools/preprocess_data.py under faults: rows that used to abort the run, damaged files, a
killed worker, SIGTERM. Every row is accepted or rejected with a reason; a damaged file or a
dead worker stops the run with a message naming it; no temporary file survives."""
from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest

from data import preprocess
from data.indexed_dataset import IndexedDataset
from data.tokenizers import ByteTokenizer
from data.workers import OrderedPool, WorkerDied
from tools.preprocess_data import PreprocessConfig, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONE = '"bad \\ud800 here"'              # JSON text of a lone surrogate escape
PAIR = '"pair \\ud83d\\ude00 is fine"'   # a proper surrogate pair: one emoji
DEEP = "[" * 100_000 + "]" * 100_000     # 100k-deep nesting: RecursionError in json.loads


def _cfg(tmp_path, inputs, **kw):
    kw.setdefault("max_rejected_fraction", 1.0)
    return PreprocessConfig(input=[str(p) for p in inputs], output_prefix=str(tmp_path / "out"), **kw)


def _rejects(tmp_path):
    return [json.loads(l) for l in open(tmp_path / "out_rejects.jsonl", encoding="utf-8")]


@pytest.mark.parametrize("kind", ["byte", "huggingface"])
def test_rows_that_used_to_abort_the_run_are_rejected_with_reasons(tmp_path, kind, hf_tokenizer_dir):
    rows = ['{"text": "first"}', '{"text": %s}' % LONE, '{"text": "x", "meta": %s}' % DEEP,
            '{"text": %s}' % PAIR, '{"text": "last"}']
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    stats = preprocess.run(_cfg(tmp_path, [tmp_path / "in.jsonl"], tokenizer_type=kind,
                                tokenizer_model=hf_tokenizer_dir if kind == "huggingface" else None),
                           progress=False)
    assert (stats.rows_read, stats.accepted) == (5, 3)
    rej = _rejects(tmp_path)
    assert [(r["line"], r["reason"]) for r in rej] == [(2, "invalid_unicode"), (3, "too_deep")]
    assert all(r["file"] == str(tmp_path / "in.jsonl") for r in rej)
    assert "lone surrogate '\\ud800'" in rej[0]["detail"]
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert len(ds) == 3


def test_a_tokenizer_exception_rejects_only_its_row(tmp_path, monkeypatch):
    """Whatever a tokenizer raises on one row (here a ValueError on rows holding 'boom'), the
    batch falls back to row-by-row encoding and only that row is lost."""
    real = ByteTokenizer.encode

    def encode(self, text):
        if "boom" in text:
            raise ValueError("tokenizer exploded")
        return real(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode", encode)
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n{"text": "boom"}\n{"text": "c"}\n')
    stats = preprocess.run(_cfg(tmp_path, [tmp_path / "in.jsonl"]), progress=False)
    assert stats.accepted == 2
    assert [(r["line"], r["reason"], r["detail"]) for r in _rejects(tmp_path)] == [
        (2, "tokenizer_error", "ValueError: tokenizer exploded")]


CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                         "arguments": {"city": "Paris"}}}]}
CHAT = [{"role": "user", "content": "weather?"}, CALL,
        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]


def test_chat_faults_and_tool_calls(tmp_path):
    """Built-in template: tool calls are rendered and trained on; lone surrogates, deep rows and
    malformed tool calls are rejected with reasons; the other rows are accepted."""
    bad_call = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}]
    rows = [json.dumps({"messages": CHAT}),
            '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": %s}]}' % LONE,
            '{"messages": %s}' % DEEP,
            json.dumps({"messages": bad_call}),
            json.dumps({"messages": CHAT[:1] + [{"role": "assistant", "content": "ok"}]})]
    (tmp_path / "c.jsonl").write_text("\n".join(rows) + "\n")
    stats = preprocess.run(_cfg(tmp_path, [tmp_path / "c.jsonl"], chat="messages"), progress=False)
    assert stats.accepted == 2
    assert [(r["line"], r["reason"]) for r in _rejects(tmp_path)] == [
        (2, "invalid_unicode"), (3, "too_deep"), (4, "invalid_tool_call")]
    text, mask = IndexedDataset(tmp_path / "out_text_document"), IndexedDataset(tmp_path / "out_loss_mask_document")
    tok = ByteTokenizer()
    trained = tok.decode(text[0][mask[0] == 1])
    assert trained == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       '</tool_call><|im_end|>It is sunny.<|im_end|>')


TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}"
    "{% endif %}{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_calls_with_a_tokenizer_template(hf_tokenizer_dir):
    """A template that never names tool_calls would drop them: the row is rejected. One that
    renders them gets the whole assistant turn masked, calls and end-of-turn included."""
    from data.chat import RowError, encode_chat
    from data.tokenizers import build_tokenizer

    tok = build_tokenizer("huggingface", hf_tokenizer_dir)
    with pytest.raises(RowError) as e:  # the fixture's template has no tool_calls
        encode_chat(tok, CHAT)
    assert e.value.reason == "tool_calls_unsupported"
    tok.chat_template = TOOL_TEMPLATE
    ids, mask = encode_chat(tok, CHAT)
    assert tok.decode(ids[mask == 1].tolist()) == (
        '<call>get_weather{"city": "Paris"}</call><|im_end|>It is sunny.<|im_end|>')


def test_truncated_or_invalid_gzip_names_the_file(tmp_path, capsys):
    data = b"".join(json.dumps({"text": f"row {i}"}).encode() + b"\n" for i in range(3000))
    z = gzip.compress(data)
    (tmp_path / "cut.jsonl.gz").write_bytes(z[: len(z) // 2])
    (tmp_path / "plain.jsonl.gz").write_bytes(data[:500])
    for name, what in [("cut.jsonl.gz", "EOFError"), ("plain.jsonl.gz", "Not a gzipped file")]:
        rc = main(["--input", str(tmp_path / name), "--output-prefix", str(tmp_path / "out"),
                   "--chunk-mb", "0.001"])
        err = capsys.readouterr().err
        assert rc == 1 and f"{tmp_path / name}: truncated or corrupt gzip stream" in err and what in err
        assert "complete rows of this file" in err
        assert sorted(os.listdir(tmp_path)) == ["cut.jsonl.gz", "plain.jsonl.gz"]
        if name == "cut.jsonl.gz":  # every whole row before the damage was read and counted
            whole_rows = zlib.decompressobj(wbits=31).decompress(z[: len(z) // 2]).count(b"\n")
            assert f"after {whole_rows:,} complete rows" in err


# --- a worker that dies --------------------------------------------------------------------

def _slow_on_three(task):
    """Pool function for the test below: task 3 reports its pid and hangs."""
    if task == 3:
        with open(os.environ["POOL_TEST_PID_FILE"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    return task * 10


def test_pool_names_the_task_of_a_killed_worker(tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("POOL_TEST_PID_FILE", str(pid_file))  # spawned workers inherit it

    def killer():
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.01)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    t0 = time.monotonic()
    got = []
    with pytest.raises(WorkerDied, match=r"died \(killed by SIGKILL\) while working on task #3"):
        with OrderedPool(2, _slow_on_three, describe=lambda t: f"task #{t}") as pool:
            for r in pool.imap(range(8)):
                got.append(r)
    assert time.monotonic() - t0 < 30
    assert got == [0, 10, 20][:len(got)]  # whatever came back before the death is in order


def test_killed_worker_stops_preprocessing_with_a_message_and_no_temporary_files(tmp_path, capsys):
    """A real run with two workers, SIGKILLed (as the OOM killer would) as soon as the first
    results are written (multiprocessing.Pool hung here forever, leaving its .tmp files). The
    run ends within 30 s, exit status 1, naming the input range a worker held (or that it was
    idle, its last result already sent), and no .tmp file is left."""
    line = json.dumps({"text": "word " * 400}) + "\n"
    (tmp_path / "big.jsonl").write_text(line * 20000)  # 40 MB, seconds of work
    bin_tmp = None

    def killer():
        import multiprocessing

        nonlocal bin_tmp
        while True:
            tmps = [f for f in os.listdir(tmp_path) if f.startswith("out_text_document.bin.tmp-")]
            if tmps and os.path.getsize(tmp_path / tmps[0]) > 0 and multiprocessing.active_children():
                bin_tmp = tmps[0]
                for child in multiprocessing.active_children():  # both: a busy one surely dies
                    os.kill(child.pid, signal.SIGKILL)
                return
            time.sleep(0.005)

    threading.Thread(target=killer, daemon=True).start()
    t0 = time.monotonic()
    rc = main(["--input", str(tmp_path / "big.jsonl"), "--output-prefix", str(tmp_path / "out"),
               "--workers", "2", "--chunk-mb", "0.5"])
    err = capsys.readouterr().err
    assert time.monotonic() - t0 < 30
    assert rc == 1 and bin_tmp is not None
    assert "died (killed by SIGKILL)" in err and "out-of-memory killer" in err
    assert f"{tmp_path / 'big.jsonl'} bytes" in err or "while idle" in err
    assert os.listdir(tmp_path) == ["big.jsonl"]


def test_sigterm_removes_temporary_files_and_stops_the_workers(tmp_path):
    psutil = pytest.importorskip("psutil")
    line = json.dumps({"text": "word " * 400}) + "\n"
    (tmp_path / "big.jsonl").write_text(line * 20000)
    proc = subprocess.Popen([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "big.jsonl"),
                             "--output-prefix", str(tmp_path / "out"), "--workers", "2", "--chunk-mb", "0.5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        tmps = [f for f in os.listdir(tmp_path) if f.startswith("out_text_document.bin.tmp-")]
        if tmps and os.path.getsize(tmp_path / tmps[0]) > 0:
            break
        time.sleep(0.005)
    workers = psutil.Process(proc.pid).children()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err[-2000:]
    assert "stopped by SIGTERM" in err
    assert os.listdir(tmp_path) == ["big.jsonl"]
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
