"""tools/generate.py: a checkpoint of any registered family speaks; greedy is the argmax of the
model's own logits at every step; sampling is seeded; a missing checkpoint is a clear error."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from core.checkpoint.sharded import save_checkpoint
from core.packed_seq import PackedSeqParams
from data.tokenizers import ByteTokenizer
from models import registry
from tools.generate import generate, load_model, main, prompt_ids

ROOT = __file__.rsplit("/tests/", 1)[0]


def _checkpoint(tmp_path, preset: str):
    spec, cfg = registry.resolve(preset)
    torch.manual_seed(0)
    model = spec.build(cfg)
    meta = {"family": spec.family, "model": cfg.to_dict(), "tokenizer": {"type": "byte", "model": None}}
    save_checkpoint(str(tmp_path / "ck"), 7, [model], None, {}, meta)
    return model.eval(), str(tmp_path / "ck")


@pytest.mark.parametrize("preset", ["tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "glm4-moe-tiny"])
def test_greedy_is_the_argmax_of_the_models_logits_for_any_family(tmp_path, capsys, preset):
    """Loaded from a checkpoint of any family, greedy decoding without a KV cache picks, at
    every step, the argmax of the teacher-forced logits over the whole final sequence."""
    saved, ck = _checkpoint(tmp_path, preset)
    model, meta, _ = load_model(ck)
    prompt = ByteTokenizer().encode("ab")
    new = generate(model, prompt, 6, 0.0, 0, stop=-1, generator=torch.Generator(), max_len=64, vocab=260)
    ids = prompt + new
    n = len(ids)
    cu = torch.tensor([0, n], dtype=torch.int32)
    with torch.no_grad():
        logits = saved(torch.tensor(ids), torch.arange(n), PackedSeqParams(cu, cu.clone(), n))
    assert len(new) == 6 and max(new) < 260  # ids past the tokenizer's 260: padding rows, never chosen
    assert logits[1:-1, :260].argmax(-1).tolist() == ids[2:]
    args = ["--load", ck, "--prompt", "ab", "--max-new-tokens", "6", "--temperature", "0", "1.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"iteration 7, {meta['family']}), tokenizer byte" in out and "tokens in" in out
    assert re.search(r"^\[greedy\] 'ab' -> '.*'$", out, re.M) and re.search(r"^\[ T=1.5\] 'ab' -> ", out, re.M)
    assert main(args) == 0  # the same seed samples the same lines again
    assert capsys.readouterr().out.split("\n")[1:3] == out.split("\n")[1:3]


def test_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["--load", str(tmp_path / "nope")]) == 1
    assert f"--load {tmp_path / 'nope'}: no such checkpoint directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["--load", str(tmp_path / "empty")]) == 1
    assert "no 'latest' pointer and not a checkpoint directory" in capsys.readouterr().err


def test_help_names_the_flags():
    out = subprocess.run([sys.executable, "tools/generate.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--load", "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--seed"):
        assert flag in out.stdout


def _imported(tmp_path):
    """A checkpoint as `convert_checkpoint.py import` writes it: meta.json records no tokenizer."""
    spec, cfg = registry.resolve("tiny")
    torch.manual_seed(0)
    save_checkpoint(str(tmp_path / "imp"), 0, [spec.build(cfg)], None, {},
                    {"family": spec.family, "model": cfg.to_dict(), "source": "/models/hf-tiny"})
    return str(tmp_path / "imp"), cfg


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 is greedy), got nan"),
    (["--temperature", "0", "inf"], "--temperature must be a finite number >= 0 (0 is greedy), got inf"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 is greedy), got -1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--tokenizer-model", "tok.json"], "--tokenizer-model needs --tokenizer-type (huggingface or "
                                        "sentencepiece): the model alone does not say how to read it"),
    (["--tokenizer-type", "byte", "--tokenizer-model", "x"], "--tokenizer-type byte takes no --tokenizer-model"),
    (["--tokenizer-type", "huggingface"], "--tokenizer-type huggingface needs --tokenizer-model"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, flags, message):
    _, ck = _checkpoint(tmp_path, "tiny")
    assert main(["--load", ck, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"generate: error: {message}\n" and captured.out == ""


def test_an_imported_checkpoint_needs_the_tokenizer_flags(tmp_path, capsys):
    ck, cfg = _imported(tmp_path)
    assert main(["--load", ck, "--max-new-tokens", "2", "--temperature", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("generate: error: ") and "records no tokenizer (a " \
        "checkpoint imported from Hugging Face): pass --tokenizer-type and --tokenizer-model (e.g. " \
        "--tokenizer-type huggingface --tokenizer-model /models/hf-tiny)" in err
    assert main(["--load", ck, "--tokenizer-type", "byte", "--max-new-tokens", "2", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert "tokenizer byte" in captured.out and captured.err == ""  # nothing recorded to differ from


def test_a_tokenizer_other_than_the_recorded_one_is_warned_of(tmp_path, capsys, sp_model_path):
    _, ck = _checkpoint(tmp_path, "tiny")  # records the byte tokenizer
    args = ["--load", ck, "--max-new-tokens", "1", "--temperature", "0"]
    assert main(args + ["--tokenizer-type", "sentencepiece", "--tokenizer-model", sp_model_path]) == 0
    assert capsys.readouterr().err == (
        "generate: warning: the run trained with --tokenizer-type byte, not the tokenizer given; unless "
        "it is a copy of that one, its ids mean other text and the lines will be garbage\n")
    assert main(args + ["--tokenizer-type", "byte"]) == 0  # the recorded one: no word
    assert capsys.readouterr().err == ""


def test_empty_and_long_prompts_and_a_capped_max_new_tokens(tmp_path, capsys):
    """An empty prompt starts from the end-of-document token; a prompt that fills the context is
    refused; --max-new-tokens past the context says what it is capped at before it starts."""
    _, ck = _checkpoint(tmp_path, "tiny")
    context = registry.resolve("tiny")[1].max_position_embeddings
    assert main(["--load", ck, "--prompt", "", "--max-new-tokens", "3", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"^\[greedy\] '' -> '.*'$", captured.out, re.M) and captured.err == ""
    long = "x" * context
    assert main(["--load", ck, "--prompt", long, "--temperature", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"generate: error: --prompt {'x' * 40!r}... is {context} tokens, and the "
                            f"model's context is {context} (max_position_embeddings): give at most "
                            f"{context - 1} tokens\n") and captured.out == ""
    prompt = "x" * (context - 3)
    assert main(["--load", ck, "--prompt", prompt, "--max-new-tokens", "100000000", "--temperature", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"generate: --max-new-tokens 100000000 is capped at 3 for --prompt "
                            f"{prompt[:40]!r} (the model's context is {context} tokens, the prompt "
                            f"{context - 3})\n")
    assert re.search(r"^\[greedy\] '.*' -> '.{0,3}'$", captured.out, re.M)


@pytest.mark.parametrize("preset", ["tiny", "qwen3-moe-tiny"])
def test_an_empty_prompt_starts_from_the_end_of_document_token(tmp_path, preset):
    """Both families: the continuation of '' is the greedy continuation of [EOD] (was a traceback
    inside attention: torch.cat() of an empty list)."""
    _, ck = _checkpoint(tmp_path, preset)
    model, _, _ = load_model(ck)
    tok = ByteTokenizer()
    assert prompt_ids(tok, "", 64, 4) == ([tok.eod_id], 4)
    new = generate(model, [tok.eod_id], 4, 0.0, 0, stop=-1, generator=torch.Generator(), max_len=64, vocab=260)
    assert len(new) == 4
    assert main(["--load", ck, "--prompt", "", "--max-new-tokens", "4", "--temperature", "0"]) == 0


def test_the_cli_refuses_nan_without_a_traceback(tmp_path):
    """As a user runs it: one line on stderr, exit 2 (the in-process tests cover the rest)."""
    ck, _ = _imported(tmp_path)
    out = subprocess.run([sys.executable, "tools/generate.py", "--load", ck, "--temperature", "nan"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == "" and out.stderr == (
        "generate: error: --temperature must be a finite number >= 0 (0 is greedy), got nan\n")
