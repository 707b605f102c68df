"""DeepSeek-V3 and GLM-4.5 through the command lines, against transformers: text documents ->
``tools/preprocess_data.py --tokenizer-type huggingface`` -> ``pretrain_step37.py --load-hf DIR``
with no --hf-config (the family and its shapes come from DIR's config.json; ``train``'s
``--model-preset tiny``, the default, is not read). The first logged loss equals the
transformers model's (``DeepseekV3ForCausalLM``, ``Glm4MoeForCausalLM``) mean cross-entropy over
every target of the same documents, each run alone. Both checkpoints are written by transformers; DeepSeek-V3's is then put in the Hub's FP8
layout (its linear weights float8_e4m3fn with a ``weight_scale_inv`` per block of a
``quantization_config.weight_block_size`` that divides none of the tiny shapes, as DeepSeek-V3 and
Kimi-K2 publish theirs): the run trains it as its fp32 dequantization, which is what transformers
runs.

Tolerance 1e-5 relative: fp32 both sides, the same weights; the two sum attention, experts and
the loss in different orders (the model tests hold logits to 4e-5 of the largest logit; a mean
over many tokens is tighter). The weights are drawn at std 0.2, not transformers' 0.02, so the
loss depends on them: the fp8 rounding itself (the loss of the unquantized weights) moves it by
over a hundred times the tolerance, asserted."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.e2e.conftest import PROCESSOR
from tests.e2e.test_training import train
from tests.unit.test_hf_fp8 import dequantize, quantize

BLOCK = [24, 40]  # rows 32, 64, 128 and columns 24, 32, 64 cut at the blocks' edges
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs!",
         "Sphinx of black quartz, judge my vow.", "How vexingly quick daft zebras jump.",
         "A latent attention compresses keys and values into one small vector per token.",
         "Experts are chosen by groups: the best groups first, then the best experts inside them."]


def _hf_checkpoint(family: str, path) -> None:
    """A tiny checkpoint of ``family`` as transformers writes it (our tiny preset's shapes, the
    tokenizer's 400-token vocabulary, weights at std 0.2, a seeded router bias)."""
    import transformers

    from models import registry

    spec = registry.spec(family)
    hf = spec.preset({"deepseek_v3": "deepseek-v3-tiny", "glm4_moe": "glm4-moe-tiny"}[family]).to_hf()
    arch = hf.pop("architectures")[0]
    hf.update(vocab_size=400, initializer_range=0.2)
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_class(**hf)).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the routing bias is read, not zero
                buf.copy_(0.05 * torch.randn(buf.shape))
    model.save_pretrained(str(path))


def _to_fp8(src, fp8, dequantized) -> int:
    """``src``'s linear weights (not the router, norms, embedding or head: as the Hub's) as fp8
    with scales in ``fp8`` (config.json with its quantization_config); their fp32 dequantization
    in ``dequantized`` (a plain checkpoint). Returns the number of fp8 tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    quantized, plain = {}, dict(tensors)
    for name, t in tensors.items():
        if t.dim() == 2 and "proj" in name:
            q, scale = quantize(t, BLOCK)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            plain[name] = dequantize(q, scale, BLOCK)
        else:
            quantized[name] = t
    for d, content in ((fp8, quantized), (dequantized, plain)):
        shutil.copytree(src, d)
        save_file(content, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": BLOCK}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return sum(t.dtype == torch.float8_e4m3fn for t in quantized.values())


def _transformers_loss(hf_dir, prefix: str) -> float:
    """Sum of token cross-entropies over every target of every document / their count, each
    document run alone through transformers."""
    from transformers import AutoModelForCausalLM

    from data.indexed_dataset import IndexedDataset

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    docs = IndexedDataset(prefix)
    total, count = 0.0, 0
    for doc in range(len(docs)):
        ids = torch.from_numpy(np.asarray(docs.get(doc), dtype=np.int64))
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0].double()
        total += float(torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        count += len(ids) - 1
    return total / count


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_first_logged_loss_equals_transformers_from_the_command_lines(family, tmp_path):
    from data.indexed_dataset import IndexedDataset
    from data.loader import open_source
    from tools.preprocess_data import main as preprocess

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    assert preprocess(["--input", str(tmp_path / "docs.jsonl"), "--output-prefix", str(tmp_path / "data" / "docs"),
                       "--tokenizer-type", "huggingface", "--tokenizer-model", PROCESSOR, "--append-eod"]) == 0
    prefix = str(tmp_path / "data" / "docs_text_document")
    assert len(IndexedDataset(prefix)) == len(TEXTS)

    hf = tmp_path / "hf"
    _hf_checkpoint(family, hf)
    load, reference = hf, hf
    if family == "deepseek_v3":  # the Hub's FP8 layout, and its fp32 dequantization for transformers
        load, reference = tmp_path / "fp8", tmp_path / "dequantized"
        assert _to_fp8(hf, load, reference) > 20  # MLA, dense, experts, shared experts
    seq = 128
    packs = open_source(prefix, seq, "truncate", 0).plan.num_packs
    rows = train(["--data-path", prefix, "--load-hf", str(load), "--tokenizer-type", "huggingface",
                  "--tokenizer-model", PROCESSOR, "--seq-length", str(seq), "--micro-batch-size", "1",
                  "--global-batch-size", str(packs), "--train-iters", "1", "--optimizer", "adamw",
                  "--lr", "1e-3", "--lr-warmup-iters", "0"], tmp_path / "log")
    want = _transformers_loss(reference, prefix)
    assert abs(rows[0]["loss"] - want) <= 1e-5 * want, (rows[0]["loss"], want)
    if family == "deepseek_v3":  # the fp8 rounding is visible at this tolerance
        unquantized = _transformers_loss(hf, prefix)
        assert abs(unquantized - want) > 100 * 1e-5 * want, (unquantized, want)
