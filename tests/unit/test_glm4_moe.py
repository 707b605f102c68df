"""Glm4MoeModel against transformers' Glm4MoeForCausalLM on the same weights (fp32, CPU): logits
per document of a THD pack (q/k norm on and off, q/k/v biases, partial rope, group-limited
routing), the export (transformers reloads it with the same logits), the MTP layer's tensors
through import -> export byte for byte, parameter counts of the presets on meta (and the cost
model's weights per token), the config reader.

Tolerance HF_REL (tests/unit/test_model_hf.py: 4e-5 of the largest value compared; measured here
<= 6e-7): the two implementations sum in different orders (per-document SDPA vs a padded causal
mask, grouped GEMM and an fp32 weighted combine vs a per-expert loop with index_add, the routed
scaling on the sum vs on each weight, renormalisation without transformers' +1e-20)."""
from __future__ import annotations

import copy

import pytest
import torch

from models.common.decoder import count_parameters
from models.glm4_moe import Glm4MoeConfig, Glm4MoeModel
from models.glm4_moe.config import PRESETS
from core.costs.flops import matmul_params_per_token
from models.registry import shapes_of, spec_for_hf
from tests.unit.hf_reference import randomize
from tests.unit.numerics import assert_close_rel
from tests.unit.test_model_hf import HF_REL, LENGTHS, thd
from tests.unit.test_model_thd import labels_for

CONFIGS = {  # the tiny preset: q/k norms, q/k/v biases, half-rotary heads, 8 experts in 4 groups (2 kept)
    "qk_norm_bias_grouped": {},
    # no q/k norm nor bias, a quarter of a 24-dim head rotating (heads x head_dim != hidden), plain
    # top-3 without renormalisation, two dense layers, two shared experts
    "plain_quarter_rope_two_dense": dict(use_qk_norm=False, attention_bias=False, head_dim=24,
                                         partial_rotary_factor=0.25, n_group=1, topk_group=1, num_experts_per_tok=3,
                                         norm_topk_prob=False, first_k_dense_replace=2, n_shared_experts=2),
}


def hf_kwargs(**overrides) -> dict:
    kw = copy.deepcopy(PRESETS["glm4-moe-tiny"])
    kw.pop("model_type")
    kw.update(overrides)
    return kw


def save_hf_model(path: str, seed: int = 0, **overrides):
    """transformers' model saved as its save_pretrained writes it: config.json says
    ``num_nextn_predict_layers`` 1 (its default) but no MTP tensors are written (it builds no MTP
    layer); ``add_mtp_layer`` adds them."""
    from transformers import Glm4MoeConfig as HFConfig
    from transformers import Glm4MoeForCausalLM

    model = Glm4MoeForCausalLM(HFConfig(**hf_kwargs(**overrides))).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model


def add_mtp_layer(path, seed: int = 0) -> dict:
    """Give a saved checkpoint GLM-4.5's MTP layer under the release's names (independent of our
    adapter): ``model.layers.{L}.*`` = a decoder layer named as transformers' last one, plus
    enorm, hnorm, eh_proj, shared_head.{norm,head} and its own embed_tokens; random values
    distinct from the main model's. Returns those tensors."""
    import json

    from safetensors.torch import load_file, save_file

    raw = json.loads((path / "config.json").read_text())
    L, H, V = raw["num_hidden_layers"], raw["hidden_size"], raw["vocab_size"]
    raw["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    f = str(path / "model.safetensors")
    main = load_file(f)
    last = f"model.layers.{L - 1}."
    shapes = {f"model.layers.{L}." + k[len(last):]: t.shape for k, t in main.items() if k.startswith(last)}
    shapes.update({f"model.layers.{L}.{k}": s for k, s in (
        ("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("eh_proj.weight", (H, 2 * H)),
        ("shared_head.norm.weight", (H,)), ("shared_head.head.weight", (V, H)), ("embed_tokens.weight", (V, H)))})
    g = torch.Generator().manual_seed(seed)
    mtp = {n: torch.randn(s, generator=g) * 0.3 for n, s in shapes.items()}
    save_file({**main, **mtp}, f, metadata={"format": "pt"})
    return mtp


def _ours(path) -> Glm4MoeModel:
    model = Glm4MoeModel(Glm4MoeConfig.from_hf(str(path)))
    report = model.load_hf(str(path))
    assert report["missing"] == [] and report["unexpected"] == [] and report["misshaped"] == []
    return model


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers_per_document(tmp_path, name):
    hf = save_hf_model(str(tmp_path), seed=3, **CONFIGS[name])
    assert hf.config.num_nextn_predict_layers == 1
    model = _ours(tmp_path)  # a folder without MTP tensors: no MTP depth built, a strict load
    assert model.config.num_mtp_layers == 0 and model.mtp is None
    tokens, pos, psp = thd(LENGTHS)
    with torch.no_grad():
        ours = model(tokens, pos, psp)
        for s, n in zip(psp.cu_seqlens.tolist(), LENGTHS):
            assert_close_rel(ours[s:s + n], hf(input_ids=tokens[s:s + n][None]).logits[0], rel=HF_REL)


def test_mtp_layer_round_trips_byte_for_byte_and_export_reloads_in_transformers(tmp_path):
    from safetensors.torch import load_file
    from transformers import Glm4MoeForCausalLM

    src, out, bare = tmp_path / "src", tmp_path / "out", tmp_path / "bare"
    save_hf_model(str(src), seed=5)
    mtp = add_mtp_layer(src, seed=6)
    model = Glm4MoeModel(Glm4MoeConfig.from_hf(str(src)))
    report = model.load_hf(str(src))  # strict: every MTP tensor has its place but the embedding copy
    assert report["kept_aside"] == 1 and report["unexpected"] == []
    L = model.config.num_layers
    assert torch.equal(model.mtp["0"].head.weight, mtp[f"model.layers.{L}.shared_head.head.weight"])
    # trained with core's MTP block: its loss beside the main one, its head a head
    tokens, pos, psp = thd([9, 6], seed=1)
    with torch.no_grad():
        losses = model(tokens, pos, psp, labels=labels_for(tokens, [9, 6]))
    assert len(losses.mtp_loss_sums) == 1 and int(losses.mtp_num_tokens[0]) == (9 - 2) + (6 - 2)
    assert {n for n, s in model.param_specs().items() if s.role == "head"} == {"lm_head.weight", "mtp.0.head.weight"}

    # import -> export with --source: every tensor of the checkpoint back byte for byte, MTP's
    # included, but the MTP layer's embedding copy: the main embedding, what the depth computed with
    # (a release's copy equals it; this checkpoint's is random: models/common/nextn_layout.py)
    assert model.save_hf(str(out), source=str(src)) == "published"
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model.safetensors"))
    copy = f"model.layers.{L}.embed_tokens.weight"
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a if k != copy)
    assert torch.equal(b[copy], a["model.embed_tokens.weight"])
    # without a source the MTP layer's embedding copy is the main embedding (what our MTP used)
    with torch.no_grad():  # train-like change so the export is not the source file again
        model.layers["1"].mlp.experts.up_proj.mul_(1.5)
    model.save_hf(str(bare))
    c = load_file(str(bare / "model.safetensors"))
    assert torch.equal(c[f"model.layers.{L}.embed_tokens.weight"], c["model.embed_tokens.weight"])

    hf, info = Glm4MoeForCausalLM.from_pretrained(str(bare), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{L}.") for k in info["unexpected_keys"])
    tokens, pos, psp = thd([17])
    with torch.no_grad():
        assert_close_rel(model(tokens, pos, psp), hf(input_ids=tokens[None]).logits[0], rel=HF_REL)
    again = _ours(bare)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    for (n, t), (_, u) in zip(model.named_buffers(), again.named_buffers()):
        assert torch.equal(t, u), n  # the routers' correction biases travel too


COUNTS = {  # transformers' Glm4MoeForCausalLM (no MTP layer), our MTP depth, the release's MTP embedding copy
    "glm-4.5": (352_797_814_784, 4_764_015_872, 151_552 * 5120),
    "glm-4.5-air": (106_852_245_504, 2_995_816_448, 151_552 * 4096),
}


@pytest.mark.parametrize("preset", COUNTS)
def test_parameter_counts_on_meta_equal_transformers(preset):
    from transformers import Glm4MoeConfig as HFConfig
    from transformers import Glm4MoeForCausalLM

    kw = {k: v for k, v in PRESETS[preset].items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        hf = Glm4MoeForCausalLM(HFConfig(**kw))
        ours = Glm4MoeModel(Glm4MoeConfig.preset(preset))
    # transformers reads num_nextn_predict_layers 1 but builds no MTP layer (it skips its tensors)
    assert hf.config.num_nextn_predict_layers == 1 and len(hf.model.layers) == kw["num_hidden_layers"]
    without, mtp, _ = COUNTS[preset]
    counts = count_parameters(ours)
    assert counts["total_without_mtp"] == sum(p.numel() for p in hf.parameters()) == without
    assert counts["mtp"] == mtp and counts["total"] == without + mtp
    # the cost model's shapes (models/glm4_moe/costs.py, MTP depth included) multiply the same
    # weights per token as the model holds: every matrix but the embedding, routed experts at top-k
    cfg, specs = ours.config, ours.param_specs()
    held = sum(p.numel() * cfg.num_experts_per_tok // cfg.num_experts if specs[n].expert_offset is not None
               else p.numel() for n, p in ours.named_parameters() if p.dim() >= 2 and specs[n].role != "embedding")
    assert matmul_params_per_token(shapes_of(cfg)) == held


def test_config_reads_the_hub_form_and_errors_are_clear():
    hub = PRESETS["glm-4.5"]
    cfg = Glm4MoeConfig.from_hf(hub)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 1000000, "partial_rotary_factor": 0.5}
    assert (cfg.use_qk_norm, cfg.attention_bias, cfg.first_k_dense_replace, cfg.num_mtp_layers) == (True, True, 3, 1)
    assert spec_for_hf(hub).family == "glm4_moe" and spec_for_hf(PRESETS["glm-4.5-air"]).family == "glm4_moe"
    assert Glm4MoeConfig.from_hf(cfg.to_hf()) == cfg  # to_hf is transformers' form, read back the same
    bare = {k: v for k, v in hub.items() if k != "partial_rotary_factor"}
    assert Glm4MoeConfig.from_hf(bare).rope_parameters["partial_rotary_factor"] == 0.5  # transformers' default
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['frobnicate'\]"):
        Glm4MoeConfig.from_hf({**hub, "frobnicate": 1})
    with pytest.raises(ValueError, match="topk_group 2 must be in"):
        Glm4MoeConfig.from_hf({**hub, "topk_group": 2})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.001 of head_dim 128 rotates 0 dims"):
        Glm4MoeConfig.from_hf({**hub, "partial_rotary_factor": 0.001})
