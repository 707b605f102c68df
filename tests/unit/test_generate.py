"""tools/generate.py: a checkpoint of any registered family speaks; greedy is the argmax of the
model's own logits at every step; sampling is seeded; a missing checkpoint is a clear error."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from core.checkpointing import save_checkpoint
from core.packed_seq import PackedSeqParams
from data.tokenizers import ByteTokenizer
from models import registry
from tools.generate import generate, load_model, main

ROOT = __file__.rsplit("/tests/", 1)[0]


def _checkpoint(tmp_path, preset: str):
    spec, cfg = registry.resolve(preset)
    torch.manual_seed(0)
    model = spec.build(cfg)
    meta = {"family": spec.family, "model": cfg.to_dict(), "tokenizer": {"type": "byte", "model": None}}
    save_checkpoint(str(tmp_path / "ck"), 7, [model], None, {}, meta)
    return model.eval(), str(tmp_path / "ck")


@pytest.mark.parametrize("preset", ["tiny", "qwen3-moe-tiny"])
def test_greedy_is_the_argmax_of_the_models_logits_for_any_family(tmp_path, capsys, preset):
    """Loaded from a checkpoint of either family, greedy decoding without a KV cache picks, at
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
