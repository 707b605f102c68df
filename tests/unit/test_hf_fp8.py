"""FP8 checkpoints in the Hub's layout (DeepSeek-V3, Kimi-K2): float8_e4m3fn weights with a
``weight_scale_inv`` per block of ``quantization_config.weight_block_size``, dequantized in fp32
by the streamed reader (core/checkpoint/hf.py). Synthetic checkpoints written with safetensors;
the reference dequantization is written out here, independently of the reader."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import core.checkpoint.hf as hfc
from models.deepseek_v3 import DeepseekV3Config, DeepseekV3Model
from tests.unit.test_model_hf import thd

BLOCK = [16, 24]  # not 128 x 128, and not dividing the tiny model's 64 columns: edge blocks are cut


def quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8, scale_inv) with one scale per block, the largest value of a block mapped to 448."""
    br, bc = block
    R, C = w.shape
    scale = torch.empty(-(-R // br), -(-C // bc))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].abs().max().clamp(min=1e-12) / 448.0
    return (w / expand(scale, block, R, C)).to(torch.float8_e4m3fn), scale


def expand(scale: torch.Tensor, block, R: int, C: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:R].repeat_interleave(block[1], 1)[:, :C]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    return q.float() * expand(scale, block, *q.shape)


def _fp8_checkpoint(tmp_path, block=BLOCK):
    """The tiny model's export, its linear weights (not the router, norms, embedding, head: as the
    Hub's) turned fp8 with scales; and beside it the same checkpoint with their fp32 dequantization."""
    model = DeepseekV3Model(DeepseekV3Config.preset("deepseek-v3-tiny"), seed=1)
    src, ref = tmp_path / "fp8", tmp_path / "dequantized"
    model.save_hf(str(src))
    model.save_hf(str(ref))
    tensors, plain = load_file(str(src / "model.safetensors")), {}
    for name in [k for k, t in tensors.items() if t.dim() == 2 and "proj" in k]:
        tensors[name], tensors[name + "_scale_inv"] = quantize(tensors[name], block)
        plain[name] = dequantize(tensors[name], tensors[name + "_scale_inv"], block)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    save_file({**load_file(str(ref / "model.safetensors")), **plain}, str(ref / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": block}
    (src / "config.json").write_text(json.dumps(cfg))
    return src, ref, tensors


def test_fp8_import_equals_its_fp32_dequantization(tmp_path, monkeypatch):
    src, ref, tensors = _fp8_checkpoint(tmp_path)
    assert sum(t.dtype == torch.float8_e4m3fn for t in tensors.values()) > 20  # MLA, dense, experts, shared
    monkeypatch.setattr(hfc, "READ_BLOCK_BYTES", 5 * 64)  # 5-row reads: blocks of rows cut inside scale blocks
    ours = DeepseekV3Model(DeepseekV3Config.from_hf(str(src)))
    report = ours.load_hf(str(src))
    assert report["unexpected"] == [] and report["missing"] == [] and report["dtypes"]["F8_E4M3"] > 0
    expected = DeepseekV3Model(DeepseekV3Config.from_hf(str(ref)))
    expected.load_hf(str(ref))
    for (n, p), (_, q) in zip(ours.named_parameters(), expected.named_parameters()):
        assert torch.equal(p, q), n  # the same fp32 products, computed by the reader and here
    tokens, pos, psp = thd([7, 5])
    with torch.no_grad():
        assert torch.isfinite(ours(tokens, pos, psp)).all()


def test_read_into_dequantizes_a_half_of_a_fused_tensor_in_row_blocks(tmp_path, monkeypatch):
    """One half of dim 1 (a fused gate_up tensor) read 3 rows at a time: its columns' scales are
    the right half's, its rows' scales follow the rows read (rows and columns cut at the edges)."""
    w = torch.randn(37, 50)
    q, s = quantize(w, [8, 10])
    save_file({"gate_up": q, "gate_up_scale_inv": s}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8",
                                                                              "weight_block_size": [8, 10]}}))
    monkeypatch.setattr(hfc, "READ_BLOCK_BYTES", 3 * 25)
    ckpt = hfc.CheckpointIndex(str(tmp_path))
    for half, cols in (("gate", slice(0, 25)), ("up", slice(25, 50))):
        out = torch.empty(30, 25)
        ckpt.read_into(out, "gate_up", half, first_row=5)
        assert torch.equal(out, dequantize(q, s, [8, 10])[5:35, cols])


def test_a_missing_scale_or_block_size_is_refused_by_name(tmp_path):
    src, _, tensors = _fp8_checkpoint(tmp_path)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = DeepseekV3Config.from_hf(str(src))
    with pytest.raises(ValueError, match=rf"{name} is F8_E4M3 without its scale {name}_scale_inv"):
        DeepseekV3Model(cfg).load_hf(str(src))  # an expert other than the first: found when read
    first = "model.layers.0.mlp.down_proj.weight"
    del tensors[first + "_scale_inv"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{first} \(for layers\.0\.mlp\.down_proj\.weight\) is F8_E4M3 without "
                                         rf"its scale {first}_scale_inv"):
        DeepseekV3Model(cfg).load_hf(str(src))  # found when planned, before anything is read
    raw = json.loads((src / "config.json").read_text())
    del raw["quantization_config"]
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"a quantized checkpoint; dequantize it to bf16 first, or add to "
                                         r".*config\.json the quantization_config\.weight_block_size it was"):
        DeepseekV3Model(cfg).load_hf(str(src))
