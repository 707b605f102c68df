"""Qwen3MoeModel against transformers' Qwen3MoeForCausalLM on the same weights (fp32, CPU):
logits per document of a THD pack, the load-balancing loss, the export, parameter counts.

Tolerance HF_REL (tests/unit/test_model_hf.py), relative to the largest value compared: the two
implementations sum in different orders (per-document SDPA vs a padded mask, grouped GEMM and an
fp32 weighted combine vs a per-expert loop with index_add)."""
from __future__ import annotations

import copy

import pytest
import torch

from models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeModel
from models.qwen3_moe.config import PRESETS
from models.registry import spec_for_hf
from tests.unit.hf_reference import randomize
from tests.unit.numerics import assert_close_rel
from tests.unit.test_model_hf import HF_REL, LENGTHS, thd
from tests.unit.test_model_thd import labels_for

CONFIGS = {
    "tiny": {},
    "no_renorm_dense_layers": dict(norm_topk_prob=False, mlp_only_layers=[1, 3], decoder_sparse_step=1),
    "sparse_step_2": dict(mlp_only_layers=[], decoder_sparse_step=2),
    "sliding_window": dict(use_sliding_window=True, sliding_window=4),
    "tied_embeddings": dict(tie_word_embeddings=True),
    "yarn_rope_bias": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                            "original_max_position_embeddings": 16}, attention_bias=True),
}


def hf_kwargs(**overrides) -> dict:
    kw = copy.deepcopy(PRESETS["qwen3-moe-tiny"])
    kw.pop("model_type")
    if "rope_parameters" in overrides:
        kw.pop("rope_theta")
    kw.update(overrides)
    return kw


def save_hf_model(path: str, seed: int = 0, **overrides):
    from transformers import Qwen3MoeConfig as HFConfig
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(HFConfig(**hf_kwargs(**overrides))).eval()
    randomize(model, seed)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path)
    return model


def _ours(path) -> Qwen3MoeModel:
    model = Qwen3MoeModel(Qwen3MoeConfig.from_hf(str(path)))
    report = model.load_hf(str(path))
    assert report["missing"] == [] and report["unexpected"] == [] and report["misshaped"] == []
    return model


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers_per_document(tmp_path, name):
    hf = save_hf_model(str(tmp_path), seed=3, **CONFIGS[name])
    model = _ours(tmp_path)
    tokens, pos, psp = thd(LENGTHS)
    with torch.no_grad():
        ours = model(tokens, pos, psp)
        for s, n in zip(psp.cu_seqlens.tolist(), LENGTHS):
            assert_close_rel(ours[s:s + n], hf(input_ids=tokens[s:s + n][None]).logits[0], rel=HF_REL)


def test_sliding_window_is_applied():
    """The window changes the logits of a document longer than it (so the test above compares
    something): the same weights with and without it differ."""
    cfg = Qwen3MoeConfig.preset("qwen3-moe-tiny")
    full = Qwen3MoeModel(cfg, seed=1)
    windowed = Qwen3MoeModel(Qwen3MoeConfig.from_hf({**cfg.to_hf(), "use_sliding_window": True,
                                                     "sliding_window": 4}), seed=1)
    tokens, pos, psp = thd([20])
    with torch.no_grad():
        a, b = full(tokens, pos, psp), windowed(tokens, pos, psp)
    assert_close_rel(a[:4], b[:4], rel=1e-6)  # same keys, blocked differently by the sdpa backend
    assert not torch.allclose(a[4:], b[4:], rtol=1e-3)


def test_load_balancing_loss_is_transformers_with_padding_excluded(tmp_path):
    """transformers on the documents as a right-padded batch with an attention mask (its aux loss
    excludes the padding) against ours on the same documents packed: the aux loss averaged over
    every MoE layer, and the objective it adds to."""
    hf = save_hf_model(str(tmp_path), seed=4, mlp_only_layers=[2])
    model = _ours(tmp_path)
    lengths = [7, 12, 3]
    tokens, pos, psp = thd(lengths, seed=2)
    rows = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(rows)
    for r, (s, n) in enumerate(zip(psp.cu_seqlens.tolist(), lengths)):
        rows[r, :n], mask[r, :n] = tokens[s:s + n], 1
    with torch.no_grad():
        ref = hf(input_ids=rows, attention_mask=mask, output_router_logits=True)
        out = model(tokens, pos, psp, labels=labels_for(tokens, lengths))
    # fp32: the same sums in another order (its counts via scatter_add over the padded batch)
    assert_close_rel(out.aux_loss, ref.aux_loss, rel=1e-6)
    assert 1.0 < float(out.aux_loss) < 2.0 * hf.config.num_experts_per_tok  # top-2: 2 when balanced


def test_export_reloads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    save_hf_model(str(tmp_path / "src"), seed=5, mlp_only_layers=[0])
    model = _ours(tmp_path / "src")
    with torch.no_grad():  # train-like change so the export is not the source file again
        model.layers["1"].mlp.experts.up_proj.mul_(1.5)
    assert model.save_hf(str(tmp_path / "out")) == "published"
    hf, info = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens, pos, psp = thd([17])
    with torch.no_grad():
        assert_close_rel(model(tokens, pos, psp), hf(input_ids=tokens[None]).logits[0], rel=HF_REL)
    again = _ours(tmp_path / "out")
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_parameter_counts_on_meta_equal_transformers(preset):
    from transformers import Qwen3MoeConfig as HFConfig
    from transformers import Qwen3MoeForCausalLM

    kw = {k: v for k, v in PRESETS[preset].items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        hf = Qwen3MoeForCausalLM(HFConfig(**kw))
        ours = Qwen3MoeModel(Qwen3MoeConfig.preset(preset))
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(ours) == count(hf)
    assert count(ours) == {"qwen3-30b-a3b": 30_532_122_624, "qwen3-235b-a22b": 235_093_634_560}[preset]


def test_config_reads_the_hub_form_and_errors_are_clear():
    hub = PRESETS["qwen3-30b-a3b"]
    cfg = Qwen3MoeConfig.from_hf({**hub, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 32768}})
    assert cfg.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                   "rope_theta": 1e6}
    assert spec_for_hf(hub).family == "qwen3_moe" and cfg.num_experts == 128 and cfg.window is None
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['frobnicate'\]"):
        Qwen3MoeConfig.from_hf({**hub, "frobnicate": 1})
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        Qwen3MoeConfig.from_hf({**hub, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not supported"):
        Qwen3MoeConfig.from_hf({**hub, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match=r"mlp_only_layers \[60\]: not layers of a 48-layer model"):
        Qwen3MoeConfig.from_hf({**hub, "mlp_only_layers": [60]})


def test_conversion_with_another_family_is_refused_by_name(tmp_path, capsys):
    from tools.convert_checkpoint import main

    save_hf_model(str(tmp_path), seed=0)
    assert main(["check", str(tmp_path)]) == 0 and "qwen3_moe: " in capsys.readouterr().out
    assert main(["check", str(tmp_path), "--model-preset", "tiny"]) == 1
    assert f"{tmp_path} holds a qwen3_moe checkpoint; --model-preset tiny is a step37 model" in capsys.readouterr().err
