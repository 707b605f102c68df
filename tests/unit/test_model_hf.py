"""Step37Model against transformers' Step3p7 on the same weights (fp32, CPU).

Tolerance HF_REL, relative to the largest value compared (the two implementations sum in
different orders: per-document SDPA vs a padded mask, grouped GEMM vs a per-expert loop)."""
from __future__ import annotations

import json

import pytest
import torch

from core.packed_seq import PackedSeqParams
from models.step37 import Step37Config, Step37Model, count_parameters
from core.checkpoint.hf import check_checkpoint
from tests.unit.hf_reference import save_full_model, save_text_model
from tests.unit.numerics import assert_close_rel

# fp32, same terms summed in another order: measured <= 4.2e-6 relative (median ~1.5e-6) over 10
# seeds for each comparison below (hidden states of 3 configs, logits, the export); 4e-5 leaves
# ~10x margin.
HF_REL = 4e-5

LENGTHS = [5, 20, 13, 1]  # window 8: two documents are longer than the sliding window


def thd(lengths, vocab=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return tokens, pos, PackedSeqParams(cu, cu.clone(), max(lengths))


CONFIGS = {
    "tiny": {},
    "no_clamp_full_rope": dict(swiglu_limits=None, swiglu_limits_shared=None, rope_scaling=None,
                               partial_rotary_factors=None),
    "all_sliding_big_clamp": dict(layer_types=["sliding_attention"] * 6, swiglu_limits=[0, 3, 3, 3, 0, 0],
                                  sliding_window=4, moe_layers_enum="0,1,2,3"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_text_model_hidden_states_match(tmp_path, name):
    hf = save_text_model(str(tmp_path), seed=3, **CONFIGS[name])
    model = Step37Model(Step37Config.from_hf(str(tmp_path)))
    report = model.load_hf(str(tmp_path), strict=False)
    assert report["misshaped"] == [] and report["unexpected"] == []
    assert set(report["missing"]) == {n for n, _ in model.named_parameters()
                                      if n == "lm_head.weight" or n.startswith("mtp.")}
    tokens, pos, psp = thd(LENGTHS)
    with torch.no_grad():
        ours = model.final_hidden(tokens, pos, psp)
        starts = psp.cu_seqlens.tolist()
        for s, n in zip(starts, LENGTHS):
            ref = hf(input_ids=tokens[s:s + n][None]).last_hidden_state[0]
            assert_close_rel(ours[s:s + n], ref, rel=HF_REL)


def test_full_model_logits_match_and_export_round_trips(tmp_path):
    """The text decoder alone read from a whole Step-3.7 checkpoint (``vision=None``): the
    vision tower is set aside and copied byte for byte (tests/unit/test_vlm_model.py: with it)."""
    src, out = tmp_path / "src", tmp_path / "out"
    hf = save_full_model(str(src), seed=5)
    model = Step37Model(Step37Config.from_hf(str(src), vision=None))
    report = model.load_hf(str(src), strict=False)
    assert report["kept_aside"] > 0 and report["unexpected"] == []
    tokens, pos, psp = thd(LENGTHS, seed=1)
    with torch.no_grad():
        logits = model(tokens, pos, psp)
        for s, n in zip(psp.cu_seqlens.tolist(), LENGTHS):
            ref = hf(input_ids=tokens[s:s + n][None]).logits[0]
            assert_close_rel(logits[s:s + n], ref, rel=HF_REL)
    assert model.save_hf(str(out), source=str(src)) == "published"
    from safetensors import safe_open
    from transformers import Step3p7ForConditionalGeneration

    reloaded, info = Step3p7ForConditionalGeneration.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():  # the export is lossless: transformers gives the same logits as before
        x = tokens[:20][None]
        assert torch.equal(reloaded(input_ids=x).logits, hf(input_ids=x).logits)
    a, b = safe_open(str(src / "model.safetensors"), "pt"), safe_open(str(out / "model.safetensors"), "pt")
    vision = [k for k in a.keys() if k.startswith(("vision_model.", "vit_large_projector."))]
    assert vision and all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in vision)
    # our own reload of the export restores every tensor, MTP depths included
    again = Step37Model(Step37Config.from_hf(str(out), vision=None))
    assert again.load_hf(str(out))["missing"] == []
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


def test_text_export_reloads_in_transformers(tmp_path):
    save_text_model(str(tmp_path / "src"), seed=2)
    model = Step37Model(Step37Config.from_hf(str(tmp_path / "src")))
    model.load_hf(str(tmp_path / "src"), strict=False)
    assert model.save_hf(str(tmp_path / "out")) == "transformers-text"
    from transformers import Step3p7TextModel

    hf, info = Step3p7TextModel.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens, pos, psp = thd([17])
    with torch.no_grad():
        assert_close_rel(model.final_hidden(tokens, pos, psp), hf(input_ids=tokens[None]).last_hidden_state[0],
                         rel=HF_REL)
    again = Step37Model(Step37Config.from_hf(str(tmp_path / "out")))
    assert again.load_hf(str(tmp_path / "out"))["missing"] == []  # head + MTP from the side file


def test_check_reports_missing_unexpected_and_misshaped(tmp_path):
    save_full_model(str(tmp_path), seed=0)
    cfg = Step37Config.from_hf(str(tmp_path), hidden_size=72, head_dim=16, num_layers=3,
                               layer_types=["full_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"],
                               swiglu_limits=[None] * 3, swiglu_limits_shared=[None] * 3)
    report = check_checkpoint(Step37Model(cfg), str(tmp_path))
    assert any(m[0] == "embed_tokens.weight" for m in report["misshaped"])
    assert any(".layers.3." in u for u in report["unexpected"])
    with pytest.raises(ValueError, match="does not fit the model"):
        Step37Model(cfg).load_hf(str(tmp_path))


def test_config_reads_legacy_and_saved_forms_alike(tmp_path):
    hf = save_text_model(str(tmp_path), seed=0)
    saved = Step37Config.from_hf(str(tmp_path))
    legacy = Step37Config.preset("tiny")
    for f in ("layer_types", "mlp_layer_types", "num_sliding_attention_heads", "rope_parameters",
              "swiglu_limits", "swiglu_limits_shared", "num_experts", "shared_expert_size",
              "moe_router_scaling_factor", "query_pre_attn_scalar", "num_mtp_layers"):
        assert getattr(saved, f) == getattr(legacy, f), f
    assert hf.config.rope_parameters["full_attention"]["rope_type"] == "llama3"
    assert legacy.rope_parameters["sliding_attention"]["rope_type"] == "default"  # scaling: full only
    step37 = {"model_type": "step3p7", "text_config": json.load(open(tmp_path / "config.json"))}
    assert Step37Config.from_hf(step37).layer_types == saved.layer_types


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['frobnicate'\]"):
        Step37Config.from_hf({**Step37Config.preset("tiny").to_hf(), "frobnicate": 1})
    bad = Step37Config.preset("tiny").to_hf()
    bad["layer_types"] = bad["layer_types"][:3]
    with pytest.raises(ValueError, match="layer_types has 3 entries; expected 4"):
        Step37Config.from_hf(bad)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        Step37Config.preset("huge")
    with pytest.raises(ValueError, match="--attention-backend 'fa9'"):
        Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), attention_backend="fa9")


def test_flash_preset_parameter_counts_on_meta():
    cfg = Step37Config.preset("step37-flash")
    with torch.device("meta"):
        model = Step37Model(cfg)
    counts = count_parameters(model, cfg)
    assert counts["total_without_mtp"] == 196_956_118_272  # transformers' count + untied head
    assert 11.9e9 < counts["active_per_token_without_mtp"] < 12.1e9
    assert cfg.layer_types[:5] == ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"]
    assert cfg.mlp_layer_types[:4] == ["dense", "dense", "dense", "sparse"]
    assert cfg.swiglu_limits[43:] == [7.0, 7.0] and cfg.swiglu_limits_shared[43:] == [16.0, 16.0]


def test_flash_preset_equals_transformers_parameter_count():
    from transformers import Step3p7TextConfig, Step3p7TextModel

    from models.step37.config import PRESETS
    from tests.unit.hf_reference import _text_kwargs_for_transformers

    kw = dict(PRESETS["step37-flash"])
    kw["num_attention_groups"] = 8
    with torch.device("meta"):
        hf = Step3p7TextModel(Step3p7TextConfig(**_text_kwargs_for_transformers(kw)))
    hf_total = sum(p.numel() for p in hf.parameters())
    assert hf_total + 128896 * 4096 == 196_956_118_272


def test_a_pipeline_stage_reads_its_part_and_still_flags_foreign_tensors(tmp_path):
    """A stage holds some layers: the other stages' tensors are not unexpected, a tensor no
    stage has a place for still is (judged against the whole model, built on meta)."""
    from safetensors.torch import load_file, save_file
    save_full_model(str(tmp_path), seed=0)
    cfg = Step37Config.from_hf(str(tmp_path))
    first = Step37Model(cfg, layers=[0, 1], last=False)
    report = check_checkpoint(first, str(tmp_path))
    assert report["missing"] == [] and report["unexpected"] == [] and report["misshaped"] == []
    last = Step37Model(cfg, layers=list(range(2, cfg.num_layers)), first=False)
    assert check_checkpoint(last, str(tmp_path))["unexpected"] == []
    shard = next(f for f in sorted(tmp_path.iterdir()) if f.suffix == ".safetensors")
    tensors = load_file(str(shard))
    tensors["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = tmp_path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["model.layers.0.self_attn.bogus.weight"] = shard.name
        index.write_text(json.dumps(data))
    assert check_checkpoint(last, str(tmp_path))["unexpected"] == ["model.layers.0.self_attn.bogus.weight"]
