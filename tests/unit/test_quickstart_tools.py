"""What the quickstart stands on: the shipped corpus (Python's documentation text, rebuilt by its
script), the BPE tokenizer trained on it, the unigram baseline and the loss-curve tool."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data import unigram
from data.indexed_dataset import IndexedDatasetWriter
from data.tokenizers import build_tokenizer
from tools import plot_loss

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "examples", "data")
sys.path.insert(0, DATA)
import make_pydoc_corpus  # noqa: E402
import train_tokenizer  # noqa: E402

SHIPPED_WITH = "3.11.7"  # the Python whose standard library wrote examples/data/pydoc_corpus.jsonl


def _corpus() -> list[dict]:
    with open(os.path.join(DATA, "pydoc_corpus.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_the_shipped_corpus_names_its_source_and_licence_and_holds_real_text():
    rows = _corpus()
    assert 2000 <= len(rows) and 1_000_000 < sum(len(r["text"]) for r in rows) < 3_000_000
    assert all(r["text"].strip() and r["source"] for r in rows)
    topics = [r for r in rows if r["source"].startswith("pydoc_data/topics.py: ")]
    assert 200 < len(topics) < len(rows) / 2  # both sources, shuffled together
    with open(os.path.join(DATA, "PYTHON_LICENSE.txt"), encoding="utf-8") as f:
        assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in f.read()
    with open(os.path.join(DATA, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert "make_pydoc_corpus.py" in readme and "PSF" in readme and SHIPPED_WITH in readme


@pytest.mark.skipif(sys.version.split()[0] != SHIPPED_WITH, reason=f"the corpus is {SHIPPED_WITH}'s text")
def test_the_script_reproduces_the_shipped_rows():
    """Every topic piece, and a sample of the docstrings (their files parsed here), is what
    make_pydoc_corpus.py writes from this interpreter's standard library."""
    rows = _corpus()
    made = {(d["source"], d["text"]) for d in make_pydoc_corpus.topic_documents(2000)}
    shipped = {(r["source"], r["text"]) for r in rows if r["source"].startswith("pydoc_data/")}
    assert shipped == made
    stdlib = make_pydoc_corpus.sysconfig.get_paths()["stdlib"]
    docs = [r for r in rows if not r["source"].startswith("pydoc_data/")][::97]
    for r in docs:
        rel, name = r["source"].split(": ")
        with open(os.path.join(stdlib, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        texts = {ast.get_docstring(n) for n in ast.walk(tree) if getattr(n, "name", "module") == name
                 and isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
        assert r["text"] in texts, r["source"]


def test_the_tokenizer_trains_deterministically_and_encodes_any_text(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in _corpus()[:300]))
    sizes = [train_tokenizer.train(str(corpus), str(tmp_path / d), 400) for d in ("a", "b")]
    assert sizes == [400, 400]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    tok = build_tokenizer("huggingface", str(tmp_path / "a"))
    text = "Déjà vu: 数据 ✓ 🚀 <|im_start|>user"
    assert tok.decode(tok.encode(text)) == text  # byte-level: nothing is unknown
    assert (tok.vocab_size, tok.eod_id, tok.pad_id) == (400, 0, 1)
    assert tok.encode("<|im_end|>") == [3]


def _dataset(tmp_path, docs) -> str:
    prefix = str(tmp_path / "d_text_document")
    w = IndexedDatasetWriter(prefix, np.uint16)
    for d in docs:
        w.add(np.array(d, dtype=np.uint16))
    w.finalize()
    return prefix


def test_unigram_entropy_by_hand(tmp_path, monkeypatch):
    # documents 0-1 hold tokens 1,1,2,3 | 3,3,3,3: p(1)=2/8, p(2)=1/8, p(3)=5/8
    prefix = _dataset(tmp_path, [[1, 1, 2], [3], [3, 3, 3, 3], [9, 9]])
    monkeypatch.setattr(unigram, "BLOCK", 3)  # counting a block at a time changes nothing
    h, n = unigram.unigram_entropy(prefix, 0, 3)
    want = -(2 / 8 * np.log(2 / 8) + 1 / 8 * np.log(1 / 8) + 5 / 8 * np.log(5 / 8))  # 0.9003 nats
    assert n == 8 and h == pytest.approx(want, abs=1e-12)
    assert unigram.unigram_entropy(prefix, 3, 4) == (0.0, 2)  # one token kind: no uncertainty
    assert unigram.token_counts(prefix).tolist() == [0, 2, 1, 5, 0, 0, 0, 0, 0, 2]


def test_plot_loss_draws_the_curve_and_says_where_the_validation_loss_is(tmp_path, capsys):
    prefix = _dataset(tmp_path, [[1, 2, 3, 4]] * 19 + [[5, 5]])
    rows = [{"iteration": 10, "loss": 2.0}, {"iteration": 20, "loss": 1.5},
            {"iteration": 20, "valid_loss": 1.2, "valid_ppl": 3.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_loss.main([str(tmp_path), "--data-path", prefix, "--split", "95,5,0"]) == 0
    out = capsys.readouterr().out
    # the training part (19 documents) has 4 equally likely tokens: ln 4 = 1.386 nats
    assert "training loss 2.000 at iteration 10 -> 1.500 at iteration 20" in out
    assert ("validation loss 1.200 nats/token at iteration 20, below the unigram entropy of the "
            "training data 1.386 nats/token (76 tokens): 0.186 under it") in out
    assert (tmp_path / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    rows[-1]["valid_loss"] = 1.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_loss.main([str(tmp_path), "--data-path", prefix, "--split", "95,5,0", "--out",
                           str(tmp_path / "x.png")]) == 0
    assert "NOT below the unigram entropy" in capsys.readouterr().out
    assert plot_loss.main([str(tmp_path / "nowhere")]) == 1
    assert "metrics.jsonl: no such file (train with --log-dir" in capsys.readouterr().err


def test_the_corpus_also_preprocesses_with_the_byte_tokenizer(tmp_path):
    out = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input",
                          os.path.join(DATA, "pydoc_corpus.jsonl"), "--output-prefix", str(tmp_path / "b"),
                          "--append-eod", "--max-rejected-fraction", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    n = len(_corpus())
    assert f"rows read {n:,}, accepted {n:,}, rejected 0" in out.stdout
